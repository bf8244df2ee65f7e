"""file_sd targets exist exactly while the job runs, in the shape Prometheus reads."""

from __future__ import annotations

import json
from pathlib import Path

from launch.targets import published_targets, scrape_host


def test_targets_file_lists_every_local_rank_and_is_removed_at_the_end(tmp_path: Path) -> None:
    with published_targets(
        str(tmp_path), run_id="r1", node_rank=1, host="127.0.0.1", ports=[19400, 19401]
    ) as path:
        assert path == tmp_path / "r1-node1.json"
        groups = json.loads(path.read_text())
        assert groups == [
            {
                "targets": ["127.0.0.1:19400", "127.0.0.1:19401"],
                "labels": {"run_id": "r1", "node": "127.0.0.1"},
            },
        ]
        assert list(tmp_path.iterdir()) == [path]  # no temp file left beside it
    assert not path.exists()


def test_targets_file_is_removed_when_the_job_fails(tmp_path: Path) -> None:
    try:
        with published_targets(str(tmp_path), run_id="r2", node_rank=0, host="h", ports=[1]):
            raise RuntimeError("worker failed")
    except RuntimeError:
        pass
    assert list(tmp_path.iterdir()) == []


def test_no_targets_dir_writes_nothing(tmp_path: Path) -> None:
    with published_targets(None, run_id="r3", node_rank=0, host="h", ports=[1]) as path:
        assert path is None


def test_wildcard_bind_address_is_scraped_by_host_name() -> None:
    assert scrape_host("127.0.0.1") == "127.0.0.1"
    assert scrape_host("0.0.0.0") not in ("0.0.0.0", "")
