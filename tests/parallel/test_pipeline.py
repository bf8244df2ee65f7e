"""Pipeline parallel (torch.distributed.pipelining) on 2 gloo ranks against the one-process oracle.

One spawn (``tests/parallel/pp_table.py``) runs GPipe, 1F1B and interleaved 1F1B with dscale's
GradScaler, torch's GradScaler beside it, and a StepGuard with the spike gate whose schedule is
rebuilt mid-run; under GPipe also the gate fed by plain ``scale()`` calls, ``policy="predictive"``,
``sync_free`` (the device-side decision) and a per-stage checkpoint resume. Torch's shape
inference is fed garbage (``_pp.garbage_tensors``): 1e8 for a schedule's first step, inf for a
rebuilt one. The oracle is the same model, global batch and microbatching in one process.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dscale
from tests.parallel import pp_table
from tests.parallel._pp import SCHEDULES, mse
from tests.parallel.pp_table import REBUILD, SPIKE, off_oracle


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return pp_table.measure(str(tmp_path_factory.mktemp("pp_ckpt")))


def _both(measured: dict[str, Any], kind: str, scenario: str) -> list[dict[str, Any]]:
    return [measured["ranks"][r][kind][scenario] for r in (0, 1)]


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_stage_skips_when_either_stage_overflows_and_equals_the_oracle(
    measured: dict[str, Any], kind: str
) -> None:
    """dscale: the inf in stage 0's grads (step 2) and in the last stage's (step 4) skips the
    step on both ranks; scales and parameters equal the one-process run bit for bit."""
    oracle = measured["oracle"][kind]["dscale"]
    assert oracle["applied"] == [True, True, False, True, False, True]
    for run in _both(measured, kind, "dscale"):
        assert run["applied"] == oracle["applied"]
        assert run["scale"] == oracle["scale"]
        assert off_oracle(run["params"], oracle["params"]) == 0.0


@pytest.mark.parametrize("kind", SCHEDULES)
def test_torch_scaler_lets_the_other_stage_step(measured: dict[str, Any], kind: str) -> None:
    """The negative control, issue 42's PP row: with torch's scaler the stage without the inf
    steps, the scales part, and both stages end off the oracle."""
    first, last = _both(measured, kind, "torch")
    assert first["applied"][2] is False and last["applied"][2] is True
    assert first["applied"][4] is True and last["applied"][4] is False
    assert first["scale"][2] * 4 == last["scale"][2]
    oracle = measured["oracle"][kind]["torch"]["params"]
    assert off_oracle(first["params"], oracle) > 1e-3 and off_oracle(last["params"], oracle) > 1e-3


@pytest.mark.parametrize("kind", SCHEDULES)
def test_the_gate_reads_the_steps_mean_loss_not_shape_inference(
    measured: dict[str, Any], kind: str
) -> None:
    """StepGuard + gate through pipeline_loss(): the loss it records is the one-process mean over
    the microbatches (bit for bit, on both ranks, the loss-less stage included), the grad norm
    the global one; the garbage of the first step's and the rebuilt schedule's shape inference
    (step 5) neither skips a step nor enters the window, so the spike at step 7 is skipped."""
    oracle = measured["oracle"][kind]["guard"]
    expected = [step != SPIKE for step in range(len(oracle["applied"]))]
    assert oracle["applied"] == expected
    for run in _both(measured, kind, "guard"):
        assert run["applied"] == expected
        assert run["loss"] == oracle["loss"]
        assert run["grad_norm"] == pytest.approx(oracle["grad_norm"], rel=1e-6)
        assert off_oracle(run["params"], oracle["params"]) == 0.0


def test_plain_scale_calls_ignore_shape_inference_under_a_rebuilt_schedule(
    measured: dict[str, Any],
) -> None:
    """The loss_fn written for torch's scaler (``scaler.scale(loss)``, a dummy scale() on the
    loss-less stage): torch's shape-inference call is not recorded, so the first step's 1e8
    garbage does not enter the window (the spike at step 7 is still caught) and the rebuilt
    schedule's inf at step 5 is no false skip."""
    expected = [
        step != SPIKE for step in range(len(measured["oracle"]["gpipe"]["guard"]["applied"]))
    ]
    for r in (0, 1):
        run = measured["ranks"][r]["gpipe_extras"]["guard_plain"]
        assert run["applied"] == expected, f"rank {r}"
        assert math.isfinite(run["loss"][0]) and math.isfinite(run["loss"][REBUILD])


@pytest.mark.parametrize("scenario", ["predictive", "sync_free"])
def test_predictive_and_sync_free_under_gpipe_equal_the_oracle(
    measured: dict[str, Any], scenario: str
) -> None:
    """policy="predictive" (the largest magnitude agreed over the stages) and sync_free (decided
    on the device): both ranks equal the one-process run bit for bit."""
    oracle = measured["oracle"][scenario]
    for r in (0, 1):
        run = measured["ranks"][r]["gpipe_extras"][scenario]
        assert False in run["applied"]
        assert run["applied"] == oracle["applied"]
        assert run["scale"] == oracle["scale"]
        assert off_oracle(run["params"], oracle["params"]) == 0.0


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_each_stage_resumes_from_its_checkpoint_bitwise(measured: dict[str, Any]) -> None:
    """GPipe, a gated GradScaler: saved after step 3 (each stage its own layers, optimizer and
    the scaler), everything built again (a new schedule infers shapes on garbage) and loaded:
    steps 4-6 equal the uninterrupted run's, parameters and scaler state bit for bit."""
    for r in (0, 1):
        extras = measured["ranks"][r]["gpipe_extras"]
        whole, resumed = extras["whole"], extras["resumed"]
        assert extras["start"] == 3
        assert resumed["applied"] == whole["applied"][3:] and False in resumed["applied"]
        assert resumed["loss"] == whole["loss"][3:]
        assert off_oracle(resumed["params"], whole["params"]) == 0.0
        assert _same_state(*extras["states"])


def test_eval_losses_are_returned_unscaled_and_not_recorded(measured: dict[str, Any]) -> None:
    """schedule.eval() between steps 3 and 4 of the gated, scaled GPipe run: its losses come
    back unscaled (the scale is 2^15 there), the gate takes none of them, and the run still
    equals the resumed one, which had no eval (previous test)."""
    first, last = (measured["ranks"][r]["gpipe_extras"]["whole"] for r in (0, 1))
    assert first["eval"] == [] and first["recorded_by_eval"] == 0
    assert last["recorded_by_eval"] == 0
    assert len(last["eval"]) == 4 and all(0.1 < loss < 10.0 for loss in last["eval"])


def test_the_table_row_says_what_was_measured(measured: dict[str, Any]) -> None:
    row = pp_table.table_row(measured)
    assert row["dscale.GradScaler"] == "both stages skip, = oracle"
    assert row["torch.amp.GradScaler"].startswith("the other stage steps; scales differ 4x")


# ----------------------------------------------------------------------------- one process
def test_step_before_scale_names_what_a_loss_less_stage_calls() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match=r"loss_fn=scaler\.pipeline_loss\(loss_fn\)"):
        dscale.GradScaler("cpu").step(opt)


def test_a_pipelined_stage_without_the_loss_steps_with_no_scale_call() -> None:
    """pipeline_loss() made on the stage: its step() places the scale itself (no dummy call)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=4.0)
    scaler.pipeline_loss(mse)
    (model(torch.ones(1, 2)).sum() * 4.0).backward()  # as the schedule's scaled backward
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.step_applied() and not torch.equal(before, model.weight)


@pytest.mark.parametrize(("reduction", "expected"), [("mean", 2.5), ("sum", 10.0)])
def test_pipeline_loss_records_the_microbatches_mean_or_sum(
    reduction: str, expected: float
) -> None:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = dscale.StepGuard("cpu", spike_signals=("loss",))
    loss_fn = guard.pipeline_loss(
        lambda out, tgt: out.sum() * 0 + tgt, microbatch_reduction=reduction
    )
    for value in (1.0, 2.0, 3.0, 4.0):
        loss_fn(model(torch.ones(1, 1)), torch.tensor(value)).backward()
    guard.step(opt)
    guard.update()
    assert guard.snapshot()["spike_loss"] == expected


def test_pipeline_loss_rejects_an_unknown_reduction() -> None:
    with pytest.raises(ValueError, match="microbatch_reduction must be one of"):
        dscale.GradScaler("cpu").pipeline_loss(mse, microbatch_reduction="avg")  # type: ignore[arg-type]


def test_the_gates_loss_is_the_mean_over_the_ranks_that_hold_one() -> None:
    """4 ranks, 2 pipeline replicas: the last stages (ranks 1, 3) send 2.0 and 4.0, the others
    -inf (no loss); the step's loss is 3.0, not 6.0 / 4."""
    from dscale.scaler._program.spike_gate import SpikeGate

    gate = SpikeGate(("loss",), sigma=6.0, window=4, warmup=2)
    gate.pipelined = True
    tail = torch.tensor([-math.inf, 2.0, -math.inf, 4.0])
    _, values, _ = gate.decide(tail, torch.zeros(()))
    assert float(values[0]) == 3.0
