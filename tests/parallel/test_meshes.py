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
    if world == 2 and 4 not in spawned:  # 2 ranks resume the 4 ranks' 2-D checkpoint
        _spawn(spawned, 4)
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


def test_a_param_group_added_mid_run_and_kept_grads_give_the_gate_the_global_norm(
    spawned: dict[Any, Any],
) -> None:
    """TP + SP (review r42a): the norm's Partial-grad params added at step 2 (add_param_group),
    and grads kept between steps (zero_grad(set_to_none=False), 2 microbatches accumulated:
    Partial on step 0, Replicate after): the gate's norm is clip_grad_norm_'s on every step."""
    for out in _spawn(spawned, 2).values():
        for name in ("late_param", "keep_grads"):
            got = out["attacks"][name]
            assert "error" not in got, got.get("error")
            for gate, true in zip(got["gate"], got["true"], strict=True):
                assert math.isclose(gate, true, rel_tol=1e-6), (name, gate, true)
        assert out["attacks"]["keep_grads"]["places"][1:] == ["(Replicate(),)"] * 2


def test_fp16_autocast_under_tp_sp_grows_and_backs_off_like_the_one_process_run(
    spawned: dict[Any, Any],
) -> None:
    """autocast fp16 under TP + SP (review r42a): dscale's GradScaler from 2^22, growing every
    step, meets real fp16 overflows; its decisions and scales are the one-process torch run's
    (backing off, then growing again), its params equal to fp32 rounding."""
    for out in _spawn(spawned, 2).values():
        got = out["attacks"]["fp16_autocast"]
        assert "error" not in got, got.get("error")
        ours, oracle = got["dscale"], got["oracle"]
        assert not all(oracle["applied"]) and any(oracle["applied"])  # both decisions met
        assert ours["applied"] == oracle["applied"]
        assert ours["scales"] == oracle["scales"]
        for a, b in zip(ours["full"], oracle["full"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["tp_sp", "fsdp"])
def test_a_checkpoint_of_four_ranks_resumes_on_two(spawned: dict[Any, Any], name: str) -> None:
    """The 2-D (FSDP2 x TP, 4 ranks) checkpoint of step 2 resumed by 2 ranks on TP + SP and on
    FSDP2 (review r42a): the same decisions and scaler state as the uninterrupted 4-rank run,
    params and momenta to fp32 rounding."""
    whole = _spawn(spawned, 4)[0]["reshard"]["whole"]
    for out in _spawn(spawned, 2).values():
        got = out["four_on_two"][name]
        assert "error" not in got, got.get("error")
        assert got["applied"] == whole["applied"][2:] == [False, True]
        assert got["scaler"] == whole["scaler"]
        for a, b in zip(got["full"] + got["momenta"], whole["full"] + whole["momenta"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_grad_kept_summed_then_freed_is_summed_again_before_the_check(
    spawned: dict[Any, Any],
) -> None:
    """Review r42a: a second optimizer's param set first seen with norm.weight's grad kept
    (Replicate, summed by the first optimizer's step); zero_grad() then frees it and sequence
    parallel makes it Partial again. Pieces finite alone (3e38) that overflow summed must skip
    the step and back the scale off on every rank (p42a's feb2337 listed only the grads Partial
    when the set was first seen: the pieces were checked alone, the weight went inf)."""
    for out in _spawn(spawned, 2).values():
        got = out["attacks"]["grads_kept_then_freed"]
        assert "error" not in got, got.get("error")
        assert got["placements"] == ["(Replicate(),)", "(Partial(sum),)"]
        assert got == {**got, "finite": True, "scale": 0.5}
