"""The FP8 numerics reach a user with no extra code: ``start_exporter`` serves them and
``MetricsLog`` logs each sample, for a ``Float8Numerics`` made on the scaler before or after."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

import dscale
import dscale.fp8 as fp8
from dscale.metrics import MetricsLog, start_exporter
from tests.fp8 import _models
from tests.tools import require_tool, run_tool


def _step(model, guard, opt, step):
    tokens, target = _models.batch(step)
    guard.scale(_models.loss_of(model, tokens, target)).backward()
    guard.step(opt)
    guard.update()
    opt.zero_grad()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


@pytest.mark.parametrize("numerics_first", [True, False])
def test_start_exporter_serves_the_numerics_and_fallback_made_on_its_scaler(
    numerics_first, tmp_path
):
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    made = []

    def make():
        numerics = fp8.Float8Numerics(model, guard, every=2)
        made.extend([numerics, fp8.Float8Fallback(numerics, guard, threshold=0.5)])

    if numerics_first:
        make()
    log = MetricsLog(tmp_path, rank=0, every=1)
    guard.add_observer(log)
    with start_exporter(guard, port=0, linger_s=0, job_name="fp8job", rank=0) as exporter:
        assert exporter.url is not None
        assert "dscale_fp8_amax{" not in _scrape(exporter.url)  # no value before a sample
        if not numerics_first:
            make()
        numerics, _ = made
        for step in range(5):  # samples at steps 0, 2, 4
            _step(model, guard, opt, step)
        text = _scrape(exporter.url)
    log.close()
    snap = numerics.snapshot()
    row = snap["blocks.1.fc2/grad_output"]
    labels = 'job_name="fp8job",layer="blocks.1.fc2",local_rank="0"'
    assert f"dscale_fp8_subnormal_ratio{{{labels}," in text
    served = [
        line
        for line in text.splitlines()
        if line.startswith("dscale_fp8_amax{")
        and 'layer="blocks.1.fc2"' in line
        and 'tensor="grad_output"' in line
    ]
    assert len(served) == 1 and float(served[0].rsplit(" ", 1)[1]) == row["amax"]
    assert "dscale_fp8_samples_total{" in text and "} 3.0" in text
    assert "dscale_fp8_fallback{" in text and "dscale_fp8_fallback_layers{" in text
    run_tool(require_tool("promtool"), "check", "metrics", stdin=text)
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "fp8-rank0.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert rows[-1]["layers"] == snap  # the last sample, as the exporter served it


def test_a_job_without_fp8_serves_and_logs_no_fp8_numerics(tmp_path):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = dscale.StepGuard("cpu")
    log = MetricsLog(tmp_path, rank=0, every=1)
    guard.add_observer(log)
    with start_exporter(guard, port=0, linger_s=0) as exporter:
        guard.scale(model(torch.ones(2, 16)).sum()).backward()
        guard.step(opt)
        guard.update()
        assert "dscale_fp8_" not in _scrape(exporter.url)
    log.close()
    assert not (tmp_path / "metrics" / "fp8-rank0.jsonl").exists()


def test_the_report_draws_a_per_layer_heatmap_of_the_logged_samples(tmp_path):
    import matplotlib.collections

    from dscale.report import figure, read_fp8_log, render

    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    outlier = model.blocks[1].fc2.register_forward_pre_hook(_blow_up)  # flushes its input
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=2)
    log = MetricsLog(tmp_path, rank=0, every=1)
    guard.add_observer(log)
    samples = {}
    for step in range(6):  # samples at 0, 2, 4
        _step(model, guard, opt, step)
        if numerics.sample_step == step:
            samples[step] = numerics.snapshot()
    outlier.remove()
    log.close()
    steps, keys, values = read_fp8_log(tmp_path)
    assert steps == [0, 2, 4] and keys == sorted(samples[0])
    want = [[samples[s][k]["flushed"] for s in steps] for k in keys]
    assert values == want
    assert max(values[keys.index("blocks.1.fc2/input")]) > 0.05  # the outlier's layer shows
    fig = figure(tmp_path, fp8=["flushed"])
    (heat_ax,) = [ax for ax in fig.axes if ax.get_ylabel().startswith("FP8")]
    (mesh,) = [c for c in heat_ax.collections if isinstance(c, matplotlib.collections.QuadMesh)]
    assert mesh.get_array().reshape(len(keys), len(steps)).tolist() == want  # what is drawn
    assert [t.get_text() for t in heat_ax.get_yticklabels()] == keys
    assert render(tmp_path).endswith("metrics.png")


def _blow_up(module, args):
    bump = torch.zeros_like(args[0])
    bump.view(-1)[0] = args[0].detach().abs().max() * 1e4
    return (args[0] + bump,)
