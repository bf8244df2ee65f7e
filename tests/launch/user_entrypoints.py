"""Entrypoints for tests/launch/test_entrypoints.py (run with the launcher's cwd = this folder)."""

from __future__ import annotations

import torch.distributed as dist

NOT_A_FUNCTION = 3


def raise_on_rank_1(ctx) -> None:
    """Rank 1 raises; rank 0 waits in a collective that rank 1 never joins."""
    if ctx.rank == 1:
        raise ValueError("boom from the user's code")
    dist.barrier()
