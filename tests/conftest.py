"""Shared fixtures: a free TCP port on 127.0.0.1; the long files are collected first."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The files that take longest (seconds of their tests together, CI's fresh-clone run of
# 2026-11-29 and `pytest -n 2 --dist loadfile --durations=0` here), longest first. `make test`
# runs `--dist loadfile`: each file goes whole to one worker, handed out in collection order
# (see pytest_configure), so a long file collected late runs alone at the end while the other
# worker waits. Collected first, they spread over both workers and the many short files fill in
# behind them. Order only: every test still runs; a file missing here (renamed, new) is collected
# in its usual place.
LONG_FILES_FIRST = (
    "tests/deploy/test_slurm.py",
    "tests/launch/test_rerun.py",
    "tests/checkpoint/test_preemption.py",
    "tests/docs/test_readme_in_order.py",
    "tests/checkpoint/test_hostile.py",
    "tests/scaler/test_differential.py",
    "tests/launch/test_entrypoints.py",
    "tests/test_bench_ops.py",
    "tests/scaler/test_compiled_ranks.py",
    "tests/docs/test_code_blocks.py",
    "tests/deploy/test_alerts.py",
    "tests/launch/test_example.py",
    "tests/fp8/test_weight_scales.py",
    "tests/fp8/test_weight_scales_loops.py",
    "tests/launch/test_jobs.py",
    "tests/scaler/test_compiled_oracles.py",
    "tests/launch/test_two_nodes.py",
    "tests/parallel/test_meshes.py",
    "tests/launch/test_compile_step.py",
    "tests/test_bench_ops_compiled.py",
    "tests/fp8/test_weight_scales_review.py",
    "tests/launch/test_choices.py",
    "tests/launch/test_bad_config.py",
    "tests/fp8/test_resume.py",
    "tests/scaler/test_device_path_reads.py",
    "tests/fp8/test_fallback.py",
    "tests/parallel/test_pipeline_attacks.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands the files out by their number of tests unless told not to (its default,
    # --loadscope-reorder): the long single-test files went last, one worker ran them alone.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    # A stable sort: each file's tests keep their order, the other files theirs.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
