"""file_sd targets name only ports a rank serves, exist exactly while it serves them."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from launch.targets import published_target, remove_targets, scrape_host, target_file
from tests.launch.launch_helpers import FAST, Launched, free_port_pair, output, wait_until


def test_target_file_names_this_ranks_port_with_its_labels_and_is_removed_at_the_end(
    tmp_path: Path,
) -> None:
    with published_target(str(tmp_path), run_id="r1", host="127.0.0.1", port=19401, rank=3) as path:
        assert path == tmp_path / "r1-127.0.0.1-19401.json"
        assert json.loads(path.read_text()) == [
            {
                "targets": ["127.0.0.1:19401"],
                "labels": {"job_name": "r1", "run_id": "r1", "rank": "3", "node": "127.0.0.1"},
            },
        ]
        assert list(tmp_path.iterdir()) == [path]  # no temp file left beside it
    assert not path.exists()


def test_target_file_is_removed_when_the_rank_fails(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError),
        published_target(str(tmp_path), run_id="r2", host="h", port=1, rank=0),
    ):
        raise RuntimeError("worker failed")
    assert list(tmp_path.iterdir()) == []


def test_a_port_that_could_not_be_bound_or_no_targets_dir_publishes_nothing(tmp_path) -> None:
    with published_target(str(tmp_path), run_id="r3", host="h", port=None, rank=0) as path:
        assert path is None and list(tmp_path.iterdir()) == []
    with published_target(None, run_id="r3", host="h", port=1, rank=0) as path:
        assert path is None


def test_launcher_removes_what_a_killed_rank_left_and_nothing_else(tmp_path: Path) -> None:
    left = target_file(tmp_path, run_id="r4", host="h", port=7)
    other_job = target_file(tmp_path, run_id="r5", host="h", port=7)
    left.write_text("[]")
    other_job.write_text("[]")
    remove_targets(str(tmp_path), run_id="r4", host="h", ports=[7, 8])
    assert list(tmp_path.iterdir()) == [other_job]


def test_wildcard_bind_address_is_scraped_by_host_name() -> None:
    assert scrape_host("127.0.0.1") == "127.0.0.1"
    assert scrape_host("0.0.0.0") not in ("0.0.0.0", "")


def _published(targets: Path) -> dict[str, list[str]]:
    """job_name (the run's name) -> the host:port targets its files name."""
    found: dict[str, list[str]] = {}
    for path in targets.glob("*.json"):
        for group in json.loads(path.read_text()):
            found.setdefault(group["labels"]["job_name"], []).extend(group["targets"])
    return found


def _served_by(target: str) -> str:
    """The job_name label of the exporter that answers on ``target``."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    match = re.search(r'^dscale_loss_scale\{[^}]*job_name="([^"]+)"', text, re.MULTILINE)
    assert match, text[:2000]
    return match.group(1)


@pytest.mark.slow
def test_two_jobs_on_one_node_with_the_same_port_each_publish_only_ports_they_serve(
    tmp_path: Path,
) -> None:
    """Crowded node: both launchers pass the port check before either's ranks bind the ports.

    Before, the second job published the first job's ports as its own targets, so Prometheus
    scraped job A under job B's run_id, and B's missing exporters never raised an alert.
    """
    port, targets = free_port_pair(), tmp_path / "targets"
    jobs = [
        Launched(
            tmp_path / name,
            *FAST,
            "model=mlp",
            "trainer.max_steps=100000",  # runs until the test stops it
            f"hydra.job.name={name}",  # the metrics' job_name
            f"metrics.port={port}",
            f"metrics.targets_dir={targets}",
            f"checkpoint.dir={tmp_path / name / 'ckpt'}",
            "checkpoint.every=100000",
            "launcher.max_restarts=0",
        )
        for name in ("a", "b")
    ]
    try:
        for name in ("a", "b"):
            wait_until(
                f"job {name} training",
                lambda name=name: (
                    "step 10/"
                    in (tmp_path / f"{name}.stdout").read_text()
                    + (tmp_path / f"{name}.stderr").read_text()
                ),
                jobs,
            )
        published = wait_until("a published target", lambda: _published(targets), jobs)
        for job_name, served in published.items():
            for target in served:
                assert _served_by(target) == job_name, (
                    f"{target} is published for {job_name} but served by another job: {published}"
                )
        # One job holds both ports and publishes both; the other warns that it cannot serve.
        assert sorted(len(t) for t in published.values()) == [2], published
    finally:
        for job in jobs:
            if job.running():
                os.killpg(job.proc.pid, signal.SIGTERM)  # preempted: save and exit 75
        results = [job.finish(120) for job in jobs]
    assert all(r.returncode == 75 for r in results), [output(r) for r in results]
    assert list(targets.iterdir()) == []
