"""Multi-rank (gloo, CPU): resharding 2 -> 1 and 2 -> 4, and per-rank scale mismatch detection."""

from __future__ import annotations

import pathlib

import torch

from tests.checkpoint import _ranks
from tests.multirank import run_ranks


def _assert_same_state(got, want):
    assert got["step"] == want["step"]
    assert got["scaler"] == want["scaler"]
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0)
    torch.testing.assert_close(got["optim"], want["optim"], rtol=0, atol=0)


def test_scale_mismatch_is_raised_on_every_rank_naming_ranks_and_values(saved_by_two_fsdp2_ranks):
    _, results = saved_by_two_fsdp2_ranks
    scale = results[0]["reference"]["scaler"]["scale"]
    for rank in (0, 1):
        saved = results[rank]["saved_error"]
        live = results[rank]["live_error"]
        assert saved is not None and live is not None, f"rank {rank} did not raise"
        values = f"(rank 0: {scale:g}, rank 1: {scale / 2:g})"
        assert f"scale differs between the saving ranks {values}" in saved
        assert f"rank 0: scale={scale:g}" in live and f"rank 1: scale={scale / 2:g}" in live
        assert results[rank]["scale_after_failed_load"] == 8.0  # rejected before any change


def test_corrupt_shard_seen_by_one_rank_raises_on_every_rank(saved_by_two_fsdp2_ranks):
    _, results = saved_by_two_fsdp2_ranks
    for rank in (0, 1):
        error = results[rank]["corrupt_error"]
        assert error is not None, f"rank {rank} did not raise"
        # Rank 1 hashes the file rank 1 wrote; rank 0 learns of it and raises the same error.
        assert "rank 1: " in error and "__1_0.distcp is corrupt" in error


def test_failed_publish_raises_on_every_rank_and_keeps_the_previous_checkpoint(
    saved_by_two_fsdp2_ranks,
):
    root, results = saved_by_two_fsdp2_ranks
    for rank in (0, 1):
        assert "simulated failure before publishing" in results[rank]["publish_error"]
        assert "rank(s) 0" in results[rank]["publish_error"]
        assert results[rank]["resumed_step"] == 3
        assert results[rank]["rng_restored"], f"rank {rank} did not get its own RNG state back"
    assert not torch.equal(results[0]["rng_draw"], results[1]["rng_draw"])
    names = sorted(p.name for p in (pathlib.Path(root) / "good").iterdir())
    assert names == [".step-4.tmp", "step-3"]


def test_fsdp2_checkpoint_of_2_ranks_loads_on_1_rank_into_a_plain_model(saved_by_two_fsdp2_ranks):
    root, results = saved_by_two_fsdp2_ranks
    loaded = run_ranks(
        _ranks.load_resharded, root, "plain", world_size=1, timeout_s=300, pg_timeout_s=120
    )
    _assert_same_state(loaded[0], results[0]["reference"])


def test_fsdp2_checkpoint_of_2_ranks_loads_on_4_fsdp2_ranks(saved_by_two_fsdp2_ranks):
    root, results = saved_by_two_fsdp2_ranks
    loaded = run_ranks(
        _ranks.load_resharded, root, "fsdp2", world_size=4, timeout_s=300, pg_timeout_s=120
    )
    for rank in range(4):
        _assert_same_state(loaded[rank], results[0]["reference"])
