"""start_exporter: per-rank HTTP endpoint, busy ports, linger, TLS, and argument checks."""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
import trustme

import dscale
from dscale.metrics import DEFAULT_PORT, TrainingFigures, start_exporter

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph")


def _scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=30, context=context) as resp:
        return resp.read().decode()


def _one_step(scaler) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()


def test_the_default_port_avoids_common_gpu_node_ports() -> None:
    ports = range(DEFAULT_PORT, DEFAULT_PORT + 8)  # 8 local ranks
    assert not {9400, 9090, 9100, 29400, 29500} & set(ports)
    assert ports[-1] < 32768  # below Linux's ephemeral range


def test_each_rank_serves_on_base_port_plus_local_rank_with_its_labels(free_port: int) -> None:
    scaler = dscale.GradScaler(device="cpu", init_scale=64.0)
    exporter = start_exporter(
        scaler, port=free_port, rank=5, local_rank=1, node="n2", job_name="e", linger_s=0
    )
    try:
        assert exporter.port == free_port + 1
        text = _scrape(f"http://127.0.0.1:{free_port + 1}/metrics")
    finally:
        exporter.stop()
    assert 'dscale_loss_scale{job_name="e",local_rank="1",node="n2",rank="5"} 64.0' in text


def test_the_loops_figures_are_served_with_the_attempt_label_and_read_no_tensor() -> None:
    scaler = dscale.GradScaler(device="cpu", init_scale=64.0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    figures = TrainingFigures(opt)
    with start_exporter(
        scaler, port=0, node="n", job_name="exp1", attempt=2, training=figures, linger_s=0
    ) as exporter:
        assert exporter.url is not None
        before = _scrape(exporter.url)
        figures.update(9, loss=2.5, tokens=640, now=100.0)
        figures.update(19, loss=2.25, tokens=640, now=102.0)  # 10 steps in 2 s
        opt.param_groups[0]["lr"] = 0.05  # a scheduler's change shows at the next scrape
        text = _scrape(exporter.url)
    labels = 'attempt="2",job_name="exp1",local_rank="0",node="n",rank="0"'
    # Before the loop reports, only the learning rate is known: no made-up zeros.
    assert [ln.split("{")[0] for ln in before.splitlines() if ln.startswith("dscale_train_")] == [
        "dscale_train_learning_rate"
    ]
    assert f"dscale_loss_scale{{{labels}}} 64.0" in text
    for name, value in [
        ("dscale_train_step", 19.0),
        ("dscale_train_loss", 2.25),
        ("dscale_train_learning_rate", 0.05),
        ("dscale_train_tokens_per_second", 3200.0),
        ("dscale_train_step_seconds", 0.2),
    ]:
        assert f"{name}{{{labels}}} {value}" in text, text


def test_rank_and_local_rank_default_to_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, job_name is the run's name (the script's), not the rendezvous id."""
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0f9c1d2e-random-per-launch")
    monkeypatch.delenv("DSCALE_JOB_NAME", raising=False)
    monkeypatch.setattr(sys, "argv", ["/home/me/proj/train_gpt.py", "--lr", "1e-3"])
    scaler = dscale.GradScaler(device="cpu")
    with start_exporter(scaler, port=0, node="n", linger_s=0) as exporter:
        assert exporter.url is not None
        text = _scrape(exporter.url)
    assert 'job_name="train_gpt",local_rank="3",node="n",rank="7"' in text


def test_job_name_defaults_to_the_launchers_run_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """dscale-launch script=... workers label with hydra.job.name (DSCALE_JOB_NAME)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0f9c1d2e-random-per-launch")
    monkeypatch.setenv("DSCALE_JOB_NAME", "exp7")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    scaler = dscale.GradScaler(device="cpu")
    with start_exporter(scaler, port=0, node="n", linger_s=0) as exporter:
        assert exporter.url is not None
        text = _scrape(exporter.url)
    assert 'job_name="exp7"' in text
    assert "random-per-launch" not in text


def test_a_busy_port_is_a_warning_and_training_goes_on(caplog, free_port: int) -> None:
    scaler = dscale.GradScaler(device="cpu", init_scale=64.0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port))
        busy.listen()
        with caplog.at_level(logging.WARNING, logger="dscale.metrics"):
            exporter = start_exporter(scaler, port=free_port, local_rank=0, linger_s=60)
        _one_step(scaler)  # the run is unaffected
        exporter.stop()  # nothing to linger for: returns at once
    assert exporter.port is None
    assert exporter.url is None
    assert f"cannot serve on 127.0.0.1:{free_port}" in caplog.text
    assert "training goes on" in caplog.text
    assert scaler.snapshot()["steps"] == 1


def test_stop_keeps_serving_while_it_lingers_then_frees_the_port() -> None:
    scaler = dscale.GradScaler(device="cpu", init_scale=64.0)
    exporter = start_exporter(scaler, port=0, linger_s=600)
    url, port = exporter.url, exporter.port
    assert url is not None
    lingering = threading.Thread(target=exporter.stop)
    lingering.start()
    try:
        assert exporter._lingering.wait(timeout=120), "stop() never started lingering"
        _one_step(scaler)  # values that change during the linger are the ones scraped
        assert "dscale_optimizer_steps_total" in _scrape(url)
        assert "} 1.0" in _scrape(url).split("dscale_optimizer_steps_total{", 1)[1].splitlines()[0]
    finally:
        exporter.stop(linger_s=0)  # cuts the linger short
        lingering.join(timeout=120)
    assert not lingering.is_alive()
    with pytest.raises(urllib.error.URLError):
        _scrape(url)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a restarted exporter does
        s.bind(("127.0.0.1", port))  # nobody listens there any more


def test_leaving_the_block_with_an_error_does_not_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = dscale.GradScaler(device="cpu")
    calls = []
    exporter = start_exporter(scaler, port=0, linger_s=600)
    real_stop = exporter.stop
    monkeypatch.setattr(exporter, "stop", lambda linger_s=None: calls.append(linger_s))
    try:
        exporter.__exit__(KeyError, KeyError("boom"), None)
        exporter.__exit__(None, None, None)
    finally:
        real_stop(linger_s=0)
    assert calls == [0, None]  # an error stops at once; a clean exit lingers


def test_tls_serves_https_with_the_given_certificate(tmp_path) -> None:
    ca = trustme.CA()  # a throwaway CA; the exporter's certificate is issued for 127.0.0.1
    cert, key, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    scaler = dscale.GradScaler(device="cpu", init_scale=16.0)
    with start_exporter(
        scaler, port=0, certfile=str(cert), keyfile=str(key), linger_s=0
    ) as exporter:
        https = f"https://127.0.0.1:{exporter.port}/metrics"
        text = _scrape(https, ssl.create_default_context(cafile=str(ca_file)))
        with pytest.raises(urllib.error.URLError):
            _scrape(https, ssl.create_default_context())  # not trusted without the CA
    assert "dscale_loss_scale{" in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"port": 70000}, "port must be an int in 0..65535, got 70000"),
        ({"port": 65535, "local_rank": 1}, "port=65535 \\+ local_rank=1 is past 65535"),
        ({"linger_s": -1}, "linger_s must be >= 0, got -1"),
        ({"certfile": "c.pem"}, "certfile and keyfile go together"),
        ({"check_agreement_every": -2}, "check_agreement_every must be an int >= 1, got -2"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        start_exporter(dscale.GradScaler(device="cpu"), **kwargs)
