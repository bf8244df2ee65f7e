"""One 2-rank spawn for every multi-rank MXFP8 / rowwise scenario (spawns cost 5-15 s here).

``results()`` runs it once per test process; tests/fp8/test_mxfp8.py,
test_numerics_granular.py, test_bench_mxfp8.py and tests/precision/test_shadow.py each check
their part of it.
"""

from __future__ import annotations

import functools
from typing import Any

from tests.multirank import run_ranks


def _every_scenario(rank: int, world_size: int) -> dict[str, Any]:
    from dscale.bench import _fp8_cli
    from tests.fp8 import _fsdp_numerics, _granular_ranks, _mx_ranks
    from tests.precision import _shadow_ranks, _stacked_ranks

    bench = {"steps": 2, "models": ["mlp"], "sweep": False, "only_mxfp8": True}
    return {
        "train": _mx_ranks.ranks(rank, world_size),
        "numerics": _granular_ranks.ranks(rank, world_size),
        "bench": _fp8_cli.run_here(bench),
        "mismatch": _mx_ranks.mismatched(rank, world_size),
        "fsdp_numerics": _fsdp_numerics.ranks(rank, world_size),
        "shadow": _shadow_ranks.ranks(rank, world_size),
        "stacked": _stacked_ranks.ranks(rank, world_size),
    }


@functools.cache
def results() -> dict[int, dict[str, Any]]:
    """``{rank: {"train": ..., "numerics": ..., "bench": ...}}`` of the one spawn."""
    return run_ranks(_every_scenario, timeout_s=300)
