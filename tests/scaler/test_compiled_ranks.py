"""Issue 46 item 2: the compiled region on 2 and 3 gloo ranks equals the eager multi-rank run.

One spawn per world size, every scenario inside: each rank trains the oracle's run
(tests/scaler/_compiled.py: growth, back-off, hysteresis, spikes, reads between steps) eagerly and
with ``step`` + ``update`` compiled ``fullgraph=True`` under ``aot_eager`` (the agreement's all-
reduce traced as ``_c10d_functional.all_reduce``). Only the last rank puts the infs into its grads,
so every skip must be agreed: torch's scaler would skip on that rank alone. Compiled must equal
eager bit for bit on every rank, and the ranks each other.

On main (2cac85f) the compiled arm raises ("Skip inlining `torch.compiler.disable()`d function").
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.multirank import run_ranks
from tests.scaler import _compiled

STEPS = 200  # past the first spikes and the underflow steps


def _record(config: str, backend: str | None, rank: int, world_size: int) -> dict[str, Any]:
    record = _compiled.run(config, backend, steps=STEPS, rank=rank, inf_rank=world_size - 1)
    return {
        "scales": record.scales,
        "applied": record.applied,
        "params": torch.stack(record.params),
        "snapshots": repr([snap for _, _, snap in record.reads]),  # repr: nan == nan
        "recompiles_after_warmup": _compiled.compiled_calls_after_warmup(record),
    }


def _compiled_and_eager(rank: int, world_size: int, configs: tuple[str, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            config: {
                "eager": _record(config, None, rank, world_size),
                "compiled": _record(config, "aot_eager", rank, world_size),
            }
            for config in configs
        }


def _assert_compiled_equals_eager_on_every_rank(out: dict[int, Any], configs: tuple[str, ...]):
    last = max(out)
    for config in configs:
        eager0 = out[0][config]["eager"]
        assert not all(eager0["applied"]), config  # the last rank's infs skipped rank 0 too
        for rank, result in out.items():
            eager, compiled = result[config]["eager"], result[config]["compiled"]
            where = (config, rank)
            assert compiled["scales"] == eager["scales"], where
            assert compiled["applied"] == eager["applied"], where
            assert torch.equal(compiled["params"], eager["params"]), where
            assert compiled["snapshots"] == eager["snapshots"], where
            assert compiled["recompiles_after_warmup"] == [], where
            # and every rank took rank 0's decisions, on the same parameters
            assert eager["applied"] == eager0["applied"], where
            assert torch.equal(eager["params"], eager0["params"]), where
        assert out[last][config]["eager"]["scales"] == eager0["scales"], config


CONFIGS_2 = tuple(_compiled.CONFIGS)
CONFIGS_3 = ("dynamic", "guard_gate")


@pytest.mark.parametrize(
    ("world_size", "configs"), [(2, CONFIGS_2), (3, CONFIGS_3)], ids=["ranks2", "ranks3"]
)
def test_the_compiled_region_equals_the_eager_multi_rank_run(
    world_size: int, configs: tuple[str, ...]
) -> None:
    out = run_ranks(_compiled_and_eager, configs, world_size=world_size, timeout_s=400.0)
    _assert_compiled_equals_eager_on_every_rank(out, configs)
