"""dscale under TP, TP + sequence parallel, FSDP2 x TP (2-D) and HSDP, torch's scaler beside it.

Two spawns (2 gloo ranks: TP, TP + SP; 4 ranks: FSDP2 x TP + SP, HSDP) run every setting under
torch's GradScaler and dscale's (dynamic, sync_free, predictive, a StepGuard with the spike gate),
with an inf written into one rank's grads at step INF_STEP; the oracle is the same model trained in
one process on the same global batch (tests/parallel/_meshes.py). The issue-42 table is built
from these results (tests/parallel/table.py) and written under the tmp dir.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from tests.multirank import run_ranks
from tests.parallel import _meshes, table
from tests.parallel._ranks import CONTROLS, SETTINGS, run_settings

DSCALE = ("dscale", "dscale_sync_free", "dscale_predictive", "step_guard_gate")
KEYS = {
    "tp_replicated_first": 2,
    "tp": 2,
    "tp_sp": 2,
    "fsdp_tp": 4,
    "hsdp": 4,
}
assert set(KEYS.values()) == set(SETTINGS)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """{world size: {rank: results}}, each world size spawned once, when first asked for."""
    return {"root": str(tmp_path_factory.mktemp("parallel_checkpoints"))}


def _spawn(spawned: dict[Any, Any], world: int) -> dict[int, dict[str, Any]]:
    if world not in spawned:
        spawned[world] = run_ranks(run_settings, spawned["root"], world_size=world, timeout_s=240)
    return spawned[world]


def _results(spawned: dict[Any, Any], key: str) -> dict[int, dict[str, Any]]:
    return {rank: out[key] for rank, out in _spawn(spawned, KEYS[key]).items()}


CASES = [
    (key, scaler) for key in KEYS for scaler in DSCALE if key not in CONTROLS or scaler == "dscale"
] + [(key, "dscale_attach") for key, world in KEYS.items() if world == 4]


@pytest.mark.parametrize(("key", "scaler"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_every_rank_skips_the_step_one_rank_overflowed_and_matches_the_oracle(
    spawned: dict[Any, Any], key: str, scaler: str
) -> None:
    """All ranks take every decision alike (the inf step skipped) through one collective per step
    (the grads' placements worked out once, not per step), scales equal, params equal to the
    one-process oracle to fp32 rounding, ranks that hold the same values bitwise equal.
    attach() (FSDP2 x TP, HSDP): the inf comes through the loss, before the reduction."""
    setting = _results(spawned, key)
    runs = {r: out[scaler] for r, out in setting.items()}
    expected = [step != _meshes.INF_STEP for step in range(_meshes.STEPS)]
    assert all(run["applied"] == expected for run in runs.values()), {
        r: run["applied"] for r, run in runs.items()
    }
    assert len({tuple(run["scales"]) for run in runs.values()}) == 1
    assert all(run["agreements"] == _meshes.STEPS for run in runs.values())  # one per step
    assert all(run["param_sets"] == 1 for run in runs.values())  # placements read once
    oracle = setting[0]["oracle"]["full"]
    for run in runs.values():
        for got, want in zip(run["full"], oracle, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    cell = table.cell(setting, scaler)
    assert cell["replica_max_abs_diff"] == 0.0


def test_attach_on_a_tensor_parallel_model_is_refused_on_every_rank(
    spawned: dict[Any, Any],
) -> None:
    """attach() folds the check into DDP's or FSDP2's reduction; a parallelize_module model has
    none, so every rank gets the same TypeError naming what it takes."""
    messages = [out["attach_tp"] for out in _spawn(spawned, 2).values()]
    assert len(set(messages)) == 1
    assert "attach() takes a DistributedDataParallel model or an FSDP2" in messages[0]
    assert "got Tiny" in messages[0]


def test_partial_pieces_whose_sum_overflows_skip_the_step_on_every_rank(
    spawned: dict[Any, Any],
) -> None:
    """Sequence parallel leaves norm.weight's grad Partial until the optimizer sums it. Pieces
    that are finite alone but overflow summed (3e38 each) are summed before the check, so the
    step is skipped and the scale backs off on every rank; torch's scaler checks the pieces,
    steps, and the optimizer writes inf into the weight (the negative control); with no extra
    collective in the step."""
    for out in _spawn(spawned, 2).values():
        got = out["partial_overflow"]
        assert got["dscale"]["grad_placements"] == "(Partial(sum),)"  # torch 2.13's SP
        assert got["dscale"] == {**got["dscale"], "finite": True, "scale": 0.5}
        assert got["torch"]["finite"] is False
        # The sum is the optimizer's own all-reduce moved forward: a clean step runs as many
        # collectives (CommDebugMode: the optimizer's, the flag's) as under torch's scaler.
        assert got["dscale"]["clean_step_collectives"] == got["torch"]["clean_step_collectives"]


@pytest.mark.parametrize("world", [2, 4], ids=["tp_sp-to-fsdp2", "fsdp2_tp-to-hsdp"])
def test_checkpoint_saved_on_one_mesh_resumes_on_another(
    spawned: dict[Any, Any], world: int
) -> None:
    """dscale.checkpoint saved after 2 steps: resumed on the same mesh the continuation (the inf
    step and one more) is bitwise the uninterrupted run's (params, momenta, scaler state);
    resumed on the other mesh (TP + SP -> FSDP2, 2-D -> HSDP) it is to fp32 rounding, with the
    same decisions and scaler state."""
    for out in _spawn(spawned, world).values():
        got = out["reshard"]
        assert "error" not in got, got.get("error")
        whole = got["whole"]
        same, other = got["same_mesh"], got["other_mesh"]
        assert same["applied"] == other["applied"] == whole["applied"][2:] == [False, True]
        assert same["scaler"] == other["scaler"] == whole["scaler"]
        for a, b in zip(same["full"] + same["momenta"], whole["full"] + whole["momenta"]):
            assert torch.equal(a, b)
        for a, b in zip(other["full"] + other["momenta"], whole["full"] + whole["momenta"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


#: torch's GradScaler, measured here: its DTensor found-inf handler reduces the flag only over the
#: mesh dims where the first grad of the group is not Replicate.
TORCH_SPLITS = {
    "tp_replicated_first": "rank(s) 0 step, 1 skip",  # w2.bias (Replicate) first: no reduction
    "tp": "all skip",  # w1.weight (Shard) first: reduced over the TP dim
    "tp_sp": "all skip",  # norm.weight's grad is Partial: reduced
    "fsdp_tp": "rank(s) 0, 2 step, 1, 3 skip",  # norm.weight (Shard dp, Replicate tp) first
    "hsdp": "rank(s) 0, 1 step, 2, 3 skip",  # (Replicate, Shard): reduced within a replica only
}


@pytest.mark.parametrize("key", KEYS)
def test_torch_scaler_beside_dscale_splits_where_the_first_grad_is_replicated(
    spawned: dict[Any, Any], key: str
) -> None:
    """The negative control: torch's ranks split in TP (replicated param first), 2-D and HSDP,
    and then its params leave the oracle and its replicas differ; dscale's never do."""
    setting = _results(spawned, key)
    torch_cell, dscale_cell = table.cell(setting, "torch"), table.cell(setting, "dscale")
    assert torch_cell["decisions"] == TORCH_SPLITS[key]
    assert dscale_cell["decisions"] == "all skip"
    if TORCH_SPLITS[key] != "all skip":
        assert len(torch_cell["scales"]) == 2  # the ranks' scales differ (2x and 4x apart)
        assert torch_cell["oracle_max_abs_diff"] > 1e-3
        assert torch_cell["replica_max_abs_diff"] > 1e-3


@pytest.mark.parametrize("key", [key for key in KEYS if key not in CONTROLS])
def test_spike_gate_reads_the_global_grad_norm(spawned: dict[Any, Any], key: str) -> None:
    """The gate's grad norm is clip_grad_norm_'s on the same DTensors (a Replicate grad counted
    once, Partial pieces summed first, HSDP's replicas once) and the one-process model's norm."""
    setting = _results(spawned, key)
    oracle = setting[0]["oracle"]["norms"]
    for run in (out["step_guard_gate"] for out in setting.values()):
        for gate, true, alone in zip(run["gate_norms"], run["true_norms"], oracle, strict=True):
            assert math.isclose(gate, true, rel_tol=1e-6), (gate, true)
            assert math.isclose(gate, alone, rel_tol=1e-6), (gate, alone)


def test_table_rows_are_written_for_the_docs(
    spawned: dict[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The issue-42 table from this run's own results: JSON and markdown under the tmp dir."""
    results = {w: _spawn(spawned, w) for w in (2, 4)}
    rows = table.rows(results)
    assert [r["setting"] for r in rows] == list(table.SETTINGS)
    out = tmp_path_factory.mktemp("parallel_table")
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(table.markdown(rows) + "\n")
    print(f"\n{out / 'table.md'}:\n{table.markdown(rows)}")
