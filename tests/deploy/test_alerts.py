"""Every alert in deploy/prometheus/rules/ fires for its fault and resolves, end to end.

A real 2-rank dscale job (tests/deploy/alert_job.py, started by the launcher with
``metrics.targets_dir``) is scraped by a real Prometheus loaded with deploy's file_sd config and
the project's rules, which sends to a real Alertmanager (Debian's ``prometheus-alertmanager``),
which posts to a webhook receiver in this process. The rules' durations are shortened with the
documented override (``deploy/prometheus/drill_rules.py``); the shipped file is not edited. One
Prometheus, Alertmanager and job serve every alert: the test walks the job through one fault
after another and checks which alerts each fault raised, then that all of them resolved.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy._tools import PROMETHEUS_DIR
from tests.launch.launch_helpers import Launched, output
from tests.ports import free_port, free_port_pair
from tests.tools import require_tool, run_tool


def _drill_rules(rules: dict[str, Any], factor: float) -> dict[str, Any]:
    """deploy/prometheus/drill_rules.py's drill_rules (a script in deploy/, not a package)."""
    spec = importlib.util.spec_from_file_location("drill_rules", PROMETHEUS_DIR / "drill_rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.drill_rules(rules, factor)


RULES = PROMETHEUS_DIR / "rules" / "dscale.rules.yml"
FP8_RULES = PROMETHEUS_DIR / "rules" / "dscale-fp8.rules.yml"
# 10m -> 5 s, 5m -> 2.5 s, 2m -> 1 s, 1m -> 0.5 s; with 1 s scrape and evaluation intervals.
FACTOR = 1 / 120
DEADLINE_S = 60.0  # for each phase
# The fault that must raise each alert (a new rule needs a fault here, or the test fails).
FAULT_OF = {
    "DScaleStepsSkippedInARow": "overflow",
    "DScaleLossScaleCollapsed": "overflow",
    "DScaleHighSkipRate": "overflow",
    "DScaleSpikeSkipsInARow": "spike",
    "DScaleRanksDisagree": "disagree",
    "DScaleExporterDown": "kill",
}
# The FP8 rules' alert driven live here (the job's one layer is float8, sampled every step); all
# FP8 alerts pass promtool's unit tests (tests/fp8/test_fp8_alerts.py).
FP8_FAULT_OF = {"DScaleFP8GradientsFlushed": "flush"}


class Webhook:
    """Alertmanager's webhook receiver: every alert it posts, with the phase it arrived in."""

    def __init__(self) -> None:
        self.phase = "start"
        self.alerts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook._lock:
                    for alert in body["alerts"]:
                        hook.alerts.append({**alert, "phase": hook.phase})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seen(self, status: str) -> dict[str, list[dict[str, Any]]]:
        """alertname -> the alerts posted with ``status`` (firing or resolved)."""
        with self._lock:
            found: dict[str, list[dict[str, Any]]] = {}
            for alert in self.alerts:
                if alert["status"] == status:
                    found.setdefault(alert["labels"]["alertname"], []).append(alert)
            return found


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def _configs(tmp: Path, webhook_port: int, am_port: int) -> tuple[Path, Path]:
    files = []
    for source in (RULES, FP8_RULES):
        rules = tmp / source.name.replace(".rules.yml", ".drill.rules.yml")
        rules.write_text(yaml.safe_dump(_drill_rules(yaml.safe_load(source.read_text()), FACTOR)))
        files.append(str(rules))
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus-file-sd.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = files
    config["alerting"] = {
        "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
    }
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    (sd,) = job["file_sd_configs"]
    sd.update(files=[str(tmp / "targets" / "*.json")], refresh_interval="1s")
    prometheus = tmp / "prometheus.yml"
    prometheus.write_text(yaml.safe_dump(config))
    alertmanager = tmp / "alertmanager.yml"
    alertmanager.write_text(
        yaml.safe_dump(
            {
                "route": {
                    "receiver": "webhook",
                    "group_by": ["alertname", "job_name", "rank"],
                    "group_wait": "0s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [
                    {
                        "name": "webhook",
                        "webhook_configs": [
                            {"url": f"http://127.0.0.1:{webhook_port}/", "send_resolved": True}
                        ],
                    }
                ],
            }
        )
    )
    return prometheus, alertmanager


def _wait(what: str, check, procs: dict[str, Any], logs: Path) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = check()
        if value:
            return value
        for name, proc in procs.items():
            running = proc.running() if isinstance(proc, Launched) else proc.poll() is None
            if not running:
                pytest.fail(f"{name} ended while waiting for {what}\n{_logs(logs)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {DEADLINE_S:.0f} s\n{_logs(logs)}")
        time.sleep(0.2)  # a poll interval, not a synchronisation


def _keys(seen: dict[str, list[dict[str, Any]]]) -> set[tuple[str, str]]:
    return {(name, a["labels"].get("rank", "")) for name, alerts in seen.items() for a in alerts}


def _logs(tmp: Path) -> str:
    parts = []
    for path in sorted([*tmp.glob("*.log"), *tmp.glob("*.stdout"), *tmp.glob("*.stderr")]):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


@pytest.mark.slow
def test_every_alert_fires_for_its_fault_and_resolves_with_job_and_rank_labels(tmp_path):
    prometheus_bin = require_tool("prometheus")
    alertmanager_bin = require_tool("prometheus-alertmanager")
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
              if "alert" in r]  # fmt: skip
    assert set(alerts) == set(FAULT_OF), f"every shipped alert needs a fault here: {alerts}"

    webhook = Webhook()
    am_port, prom_port, metrics_port = free_port(), free_port(), free_port_pair()
    prometheus_yml, alertmanager_yml = _configs(tmp_path, webhook.port, am_port)
    control = tmp_path / "phase"
    control.write_text("clean")
    procs: dict[str, Any] = {}
    try:
        procs["alertmanager"] = _start(
            [alertmanager_bin, f"--config.file={alertmanager_yml}",
             f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
             "--cluster.listen-address="],
            tmp_path / "alertmanager.log",
        )  # fmt: skip
        procs["prometheus"] = _start(
            [prometheus_bin, f"--config.file={prometheus_yml}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp_path / "prometheus.log",
        )  # fmt: skip
        procs["job"] = Launched(
            tmp_path / "job",
            "entrypoint=tests.deploy.alert_job:main",
            f"+args.control={control}",
            "+args.pace_s=0.1",
            "launcher.nproc_per_node=2",
            "launcher.max_restarts=1",
            "scaler.init_scale=1024",
            "scaler.min_scale=64",
            "scaler.growth_interval=5",
            "scaler.spike_signals=[loss]",
            "scaler.spike_window=8",
            "scaler.spike_warmup=4",
            f"metrics.port={metrics_port}",
            f"metrics.targets_dir={tmp_path / 'targets'}",
            "metrics.check_agreement_every=1",
            "metrics.linger_s=0",
            "checkpoint.enabled=false",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        )
        targets = tmp_path / "targets"
        target_labels = _wait(
            "both ranks' targets",
            lambda: (
                len(list(targets.glob("*.json"))) == 2
                and json.loads(next(targets.glob("*.json")).read_text())[0]["labels"]
            ),
            procs,
            tmp_path,
        )
        # Alerts name the run (hydra.job.name), stable across reruns, not this attempt's
        # rendezvous id.
        job_name = target_labels["job_name"]
        assert job_name == "dscale" != target_labels["run_id"], target_labels

        def scraped_up() -> bool:
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?query=up%7Bjob%3D%22dscale%22%7D"
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    result = json.loads(resp.read())["data"]["result"]
            except OSError:
                return False
            return len([s for s in result if s["value"][1] == "1"]) == 2

        _wait("Prometheus scraping both ranks", scraped_up, procs, tmp_path)

        for phase in ("overflow", "spike", "disagree", "flush", "kill"):
            webhook.phase = phase
            control.write_text(phase)
            expected = {
                name for name, fault in {**FAULT_OF, **FP8_FAULT_OF}.items() if fault == phase
            }
            _wait(
                f"firing {sorted(expected)} during {phase}",
                lambda expected=expected: expected <= set(webhook.seen("firing")),
                procs,
                tmp_path,
            )
        webhook.phase = "done"
        control.write_text("done")  # the job ends; its targets go, and with them its series
        result = procs.pop("job").finish(60)
        assert result.returncode == 0, output(result)
        _wait(
            "every alert resolved, on every rank it fired for",
            lambda: _keys(webhook.seen("firing")) <= _keys(webhook.seen("resolved")),
            procs,
            tmp_path,
        )
    finally:
        for name in ("job", "prometheus", "alertmanager"):
            proc = procs.get(name)
            if isinstance(proc, Launched):
                proc.kill()
            elif proc is not None:
                _stop(proc)
        webhook.server.shutdown()

    firing = webhook.seen("firing")
    for name, fault in {**FAULT_OF, **FP8_FAULT_OF}.items():
        # Raised by its own fault, not by an earlier one (a second rank may follow later).
        assert firing[name][0]["phase"] == fault, (name, firing[name][0])
        for alert in firing[name]:
            labels = alert["labels"]
            # What a human acts on: which job, which rank, which scrape job.
            assert labels["job_name"] == job_name and labels["job"] == "dscale", (name, labels)
            assert labels["rank"] in {"0", "1"}, (name, labels)
    assert "1" in {a["labels"]["rank"] for a in firing["DScaleExporterDown"]}
    flushed = firing["DScaleFP8GradientsFlushed"]  # the job's one float8 layer, its gradient
    assert {(a["labels"]["layer"], a["labels"]["tensor"]) for a in flushed} == {
        ("0", "grad_output")
    }
    assert _keys(firing) <= _keys(webhook.seen("resolved"))
    assert not list((tmp_path / "targets").glob("*.json"))


def test_drill_override_shortens_every_duration_and_leaves_the_rules_otherwise_alone(tmp_path):
    shipped = yaml.safe_load(RULES.read_text())
    drill = _drill_rules(yaml.safe_load(RULES.read_text()), 0.01)
    for group, drill_group in zip(shipped["groups"], drill["groups"], strict=True):
        for rule, short in zip(group["rules"], drill_group["rules"], strict=True):
            assert {k: v for k, v in short.items() if k not in ("for", "expr")} == {
                k: v for k, v in rule.items() if k not in ("for", "expr")
            }
            if "for" in rule:
                assert short["for"] != rule["for"] and short["for"].endswith("ms")
            assert ("[10m]" in rule["expr"]) == ("[6000ms]" in short["expr"])
    path = tmp_path / "drill.yml"
    path.write_text(yaml.safe_dump(drill))
    run_tool(require_tool("promtool"), "check", "rules", str(path))
