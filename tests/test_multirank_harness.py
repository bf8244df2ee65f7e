"""The multi-rank harness itself: large results come back instead of hanging the test."""

from __future__ import annotations

import torch

from tests.multirank import run_ranks


def _large_result(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((1_000_000,), float(rank))  # 4 MB: far past a pipe's 64 KiB buffer


def test_results_larger_than_a_pipe_buffer_come_back_from_every_rank() -> None:
    out = run_ranks(_large_result, timeout_s=120)
    assert {r: float(v.sum()) for r, v in out.items()} == {0: 0.0, 1: 1_000_000.0}
