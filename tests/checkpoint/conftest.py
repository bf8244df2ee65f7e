"""Checkpoint fixtures shared by several test files (one 2-rank spawn serves them all)."""

from __future__ import annotations

import pytest

from tests.checkpoint import _ranks
from tests.multirank import run_ranks


@pytest.fixture(scope="session")
def saved_by_two_fsdp2_ranks(tmp_path_factory):
    """``root/good/step-3`` saved by 2 FSDP2 ranks, with every rank's failure scenarios."""
    root = str(tmp_path_factory.mktemp("fsdp2"))
    return root, run_ranks(
        _ranks.save_then_check_failures,
        root,
        "fsdp2",
        world_size=2,
        timeout_s=300,
        pg_timeout_s=120,
    )
