"""One choice for all ranks, and hashing spread over the ranks (2 gloo ranks, one spawn).

resume("auto") is decided on rank 0; a rank that cannot read makes every rank raise the same
error; each rank hashes the files it writes and its share of what it reads.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint import _ranks
from tests.multirank import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("agree"))
    return run_ranks(
        _ranks.one_choice_for_all_ranks, root, world_size=2, timeout_s=300, pg_timeout_s=60
    )


def test_auto_resume_loads_rank_0s_choice_on_every_rank_even_if_rank_1_lists_less(results):
    assert results[0]["auto_step"] == results[1]["auto_step"] == 4
    for name, value in results[0]["auto_params"].items():
        assert torch.equal(results[1]["auto_params"][name], value), name


@pytest.mark.parametrize("what", ["metadata", "data"])
def test_one_rank_failing_to_read_raises_the_same_error_on_every_rank(results, what):
    assert results[0][what] is not None and results[0][what] == results[1][what]
    kind, message = results[0][what]
    assert kind == "CheckpointError"
    assert "rank(s) 1" in message or "(ranks [1])" in message
    assert "Permission denied" in message or "Input/output" in message
    assert "step-4" in message
    assert results[0][f"{what}_unchanged"] and results[1][f"{what}_unchanged"]


def test_each_rank_hashes_the_files_it_writes_and_its_share_of_what_it_reads(results):
    """Rank 0 merges digests; it does not hash the other ranks' files (they would outlast the
    process-group timeout at 100 GB)."""
    for rank in (0, 1):
        saved = results[rank]["hashed_on_save"]
        data = [n for n in saved["written"] if n.endswith(".distcp")]
        assert data and all(n.startswith(f"__{rank}_") for n in data), saved
        small = sorted(set(saved["read"]))
        assert small == ([".metadata", "dscale.json"] if rank == 0 else []), saved
        loaded = results[rank]["hashed_on_load"]["read"]
        data = [n for n in loaded if n.endswith(".distcp")]
        assert data and all(n.startswith(f"__{rank}_") for n in data), loaded
