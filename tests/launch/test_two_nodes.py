"""Two launcher processes on this machine as two nodes: c10d rendezvous on 127.0.0.1, one rank each.

Each node is its own Hydra process with its own run folder; the checkpoint folder is shared, as a
cluster's shared file system would be. c10d numbers the nodes in the order they join, so either
node may hold global rank 0 (and write summary.json).

The demo's entrypoint runs here. The example project's (examples/tiny_regression) goes through
the same RunContext, rendezvous and checkpoint code; its own job (skip, metrics, exact resume)
is tests/launch/test_example.py, so its two-node copy of this test was dropped for time.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from launch_helpers import (
    FAST,
    ROOT,
    Launched,
    free_port,
    leftover_workers,
    output,
    summary,
)

pytestmark = pytest.mark.slow

DEMO = [*FAST, "model=mlp", "checkpoint.every=4"]


def _two_nodes(run: Path, *overrides: str) -> tuple[dict[str, Any], dict[int, str]]:
    """Start both nodes, wait for both; return the summary and each global rank's log."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    nodes = [
        Launched(
            run / f"node{n}",
            *DEMO,
            "launcher.nnodes=2",
            "launcher.nproc_per_node=1",
            "launcher.rdzv_backend=c10d",
            f"launcher.rdzv_endpoint={endpoint}",
            f"launcher.rdzv_id={run_id}",
            # The first node hosts the rendezvous store; both wait at most 60 s for the other.
            f"launcher.rdzv_conf='is_host={1 - n},join_timeout=60'",
            "launcher.pg_timeout_s=120",
            "metrics.enabled=false",  # both nodes' local rank 0 would want the same port
            *overrides,
            cwd=ROOT,
        )
        for n in (0, 1)
    ]
    try:
        done = [node.finish(timeout_s=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for n, proc in enumerate(done):
        assert proc.returncode == 0, f"node {n}: {output(proc)}"
        assert leftover_workers(run / f"node{n}") == []
    written = [run / f"node{n}" for n in (0, 1) if (run / f"node{n}" / "summary.json").exists()]
    summaries = [summary(folder) for folder in written]
    assert len(summaries) == 1  # only the node holding global rank 0 writes it
    logs = {}
    for n in (0, 1):
        for log in (run / f"node{n}" / "logs").glob("rank*.log"):
            logs[int(log.stem.removeprefix("rank"))] = log.read_text()
    assert sorted(logs) == [0, 1]  # one rank per node, each logging in its own node's folder
    return summaries[0], logs


def test_two_nodes_skip_one_nodes_inf_together_and_resume_together(tmp_path: Path) -> None:
    ckpt = f"checkpoint.dir={tmp_path / 'shared-checkpoints'}"
    first, logs = _two_nodes(
        tmp_path / "first", ckpt, "trainer.max_steps=12", "fault.inf_steps=[5]"
    )
    assert (first["world_size"], first["steps"], first["resumed_from"]) == (2, 12, None)
    assert [r["skipped_steps"] for r in first["ranks"]] == [[5], [5]]
    assert first["ranks"][0]["final_scale"] == first["ranks"][1]["final_scale"]
    for rank in (0, 1):
        assert re.findall(r"step (\d+) skipped", logs[rank]) == ["5"]

    # Both nodes restart; both resume from the shared step-12 and go on to 20.
    again, logs = _two_nodes(
        tmp_path / "again", ckpt, "trainer.max_steps=20", "fault.inf_steps=[5,15]"
    )
    assert (again["world_size"], again["steps"], again["resumed_from"]) == (2, 20, 12)
    assert [r["resumed_from"] for r in again["ranks"]] == [12, 12]
    assert [r["skipped_steps"] for r in again["ranks"]] == [[5, 15], [5, 15]]
    assert again["ranks"][0]["final_scale"] == again["ranks"][1]["final_scale"]
    for rank in (0, 1):
        assert re.findall(r"step (\d+) skipped", logs[rank]) == ["15"]  # 5 came from step-12
