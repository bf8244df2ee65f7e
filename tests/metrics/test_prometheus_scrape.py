"""End to end: a torchrun 2-rank job scraped by a real Prometheus using deploy/'s config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy._tools import DEPLOY, PROMETHEUS_DIR, ROOT
from tests.ports import free_port, free_port_pair
from tests.tools import require_tool

DEADLINE_S = 240.0
POLL_S = 0.5  # poll interval of the HTTP API while waiting for state; not a synchronisation


def _prometheus_config(tmp: Path, base_port: int, discovery: str) -> Path:
    """deploy/prometheus's config for ``discovery`` with this job's targets and 1 s intervals."""
    name = {"static": "prometheus.yml", "file_sd": "prometheus-file-sd.yml"}[discovery]
    config = yaml.safe_load((PROMETHEUS_DIR / name).read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / r) for r in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["scrape_interval"] = "1s"
    targets = [f"127.0.0.1:{base_port}", f"127.0.0.1:{base_port + 1}"]
    if discovery == "static":
        job["static_configs"][0]["targets"] = targets
    else:  # what the launcher writes for a run: one target group per run
        (sd,) = job["file_sd_configs"]
        sd["files"] = [str(tmp / "targets" / "*.json")]
        sd["refresh_interval"] = "1s"
        (tmp / "targets").mkdir()
        group = [{"targets": targets, "labels": {"run_id": "e2e"}}]
        (tmp / "targets" / "e2e.json").write_text(json.dumps(group))
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _api(port: int, path: str, **params: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 400 carries the PromQL error as JSON
        return json.loads(exc.read())


def _wait_for(what: str, check, procs: dict[str, subprocess.Popen]) -> Any:
    """Poll ``check()`` until it returns a truthy value; fail early if a process died."""
    deadline = time.monotonic() + DEADLINE_S
    last: Any = None
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                out = _LOGS[proc.pid].read_text()
                pytest.fail(f"{name} exited {proc.returncode} while waiting for {what}:\n{out}")
        try:
            last = check()
        except OSError as exc:  # not listening yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(POLL_S)
    pytest.fail(f"timed out after {DEADLINE_S:.0f}s waiting for {what}; last seen: {last!r}")


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun forwards it to its workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    return _LOGS[proc.pid].read_text()


_LOGS: dict[int, Path] = {}  # pid -> its log file (a file, not a pipe nobody drains)


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    _LOGS[proc.pid] = log
    return proc


def _grafana_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "dscale.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    # What Grafana substitutes before sending a query.
    subs = {'"$job_name"': '"e2e"', "$__rate_interval": "1m", "$__range": "5m"}
    for old, new in subs.items():
        exprs = [e.replace(old, new) for e in exprs]
    return exprs


@pytest.mark.slow
@pytest.mark.parametrize("discovery", ["static", "file_sd"])
def test_prometheus_scrapes_both_ranks_final_scale_and_grafana_queries_parse(
    tmp_path, discovery: str
) -> None:
    prometheus = require_tool("prometheus")
    base_port, prom_port = free_port_pair(), free_port()
    out = tmp_path / "run"
    out.mkdir()
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["prometheus"] = _start(
            [prometheus, f"--config.file={_prometheus_config(tmp_path, base_port, discovery)}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp_path / "prometheus.log",
        )  # fmt: skip
        procs["torchrun"] = _start(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(ROOT / "tests" / "metrics" / "e2e_train.py"), "--port", str(base_port),
             "--out", str(out), "--linger-s", "600"],
            tmp_path / "torchrun.log",
        )  # fmt: skip
        finals = _wait_for(
            "both ranks' final counters",
            lambda: (
                all((out / f"final-rank{r}.json").exists() for r in (0, 1))
                and {r: json.loads((out / f"final-rank{r}.json").read_text()) for r in (0, 1)}
            ),
            procs,
        )
        # The job: init 1024, growth every 3 clean steps, one agreed overflow at step 5 of 10.
        # 1024 -> 2048 after steps 1-3, back to 1024 at step 5, 2048 again after steps 6-8.
        assert finals[0] == finals[1]
        assert (finals[0]["scale"], finals[0]["skipped_steps"], finals[0]["steps"]) == (2048, 1, 10)
        expected = {str(r): finals[r]["scale"] for r in (0, 1)}

        def scraped_final_scales():
            res = _api(prom_port, "/api/v1/query", query='dscale_loss_scale{job_name="e2e"}')
            got = {s["metric"]["rank"]: float(s["value"][1]) for s in res["data"]["result"]}
            return got == expected and got

        got = _wait_for(
            f"dscale_loss_scale == {expected} for both ranks", scraped_final_scales, procs
        )
        assert got == expected

        res = _api(
            prom_port, "/api/v1/query", query='dscale_optimizer_steps_skipped_total{job_name="e2e"}'
        )
        assert sorted(float(s["value"][1]) for s in res["data"]["result"]) == [1.0, 1.0]
        for expr in _grafana_exprs():
            res = _api(prom_port, "/api/v1/query", query=expr)
            assert res["status"] == "success", (expr, res)
        res = _api(prom_port, "/api/v1/query", query=_grafana_exprs()[0])
        assert len(res["data"]["result"]) == 2
        loaded = {g["name"]: g["rules"] for g in _api(prom_port, "/api/v1/rules")["data"]["groups"]}
        for name in ("dscale", "dscale-fp8"):  # both shipped rule files
            rules_file = yaml.safe_load(
                (PROMETHEUS_DIR / "rules" / f"{name}.rules.yml").read_text()
            )
            assert len(loaded[name]) == len(rules_file["groups"][0]["rules"])  # every rule loaded
            assert all(r["health"] != "err" for r in loaded[name]), loaded[name]
    finally:
        for proc in procs.values():
            _stop(proc)
    rows = [json.loads(line) for line in (out / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10))
    assert [r["skipped"] for r in rows] == [False] * 4 + [True] + [False] * 5
