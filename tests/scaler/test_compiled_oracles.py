"""Issue 46 item 2: the compiled region (``step`` + ``update``) against eager dscale, its oracle.

Each configuration trains 500 iterations eagerly and with the region compiled ``fullgraph=True``,
with the same injected events (tests/scaler/_compiled.py): infs in one grad (skips, back-offs,
hysteresis), growth, loss spikes (the gate, through its warm-up and a full window), steps whose
grads underflow in fp16 (predictive's sampled share), predictive's range iterations (every 16th),
and ``counters()`` / ``snapshot()`` read between iterations; a separate, shorter run loads an
earlier state mid-run (``load_state_dict``). Under ``aot_eager`` (SGD foreach + momentum) every
scale, decision, read and parameter must equal eager's bit for bit; under Inductor the decisions,
scales and counters must, and the parameters may differ only as much as the same optimizer compiled
without any scaler differs from eager (torch's codegen, the control). After the warm-up, no
recompile in 500 iterations, counted by torch's recompile logging.

On main (2cac85f) every one fails: ``step()`` and ``update()`` are ``torch.compiler.disable``d, so
``fullgraph=True`` raises "Skip inlining `torch.compiler.disable()`d function".
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings

import pytest
import torch

from dscale.scaler._program.agreement import RANGE_EVERY
from tests.scaler import _compiled
from tests.scaler._compiled import Record

STEPS = 500
INDUCTOR_STEPS = 300
CONFIGS = tuple(_compiled.CONFIGS)

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph")


def _both(
    config: str, backend: str, steps: int = STEPS, *, load: bool = False
) -> tuple[Record, Record]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _compiled.run(config, None, steps=steps, load=load)
        compiled = _compiled.run(config, backend, steps=steps, load=load)
    return eager, compiled


@pytest.fixture(scope="module")
def aot_eager_runs() -> dict[str, tuple[Record, Record] | BaseException]:
    """Every configuration, eager and compiled with aot_eager: run once, read by every test
    (a configuration whose compiled run raised holds the exception, raised by its tests)."""
    runs: dict[str, tuple[Record, Record] | BaseException] = {}
    for config in CONFIGS:
        try:
            runs[config] = _both(config, "aot_eager")
        except AssertionError as exc:  # _compiled.run names the iteration that raised
            runs[config] = exc
    return runs


def _runs(runs: dict[str, tuple[Record, Record] | BaseException], config: str):
    result = runs[config]
    if isinstance(result, BaseException):
        raise result
    return result


def _assert_same_reads(eager: Record, compiled: Record, config: str) -> None:
    assert len(eager.reads) == len(compiled.reads), config
    for (i, counters_e, snap_e), (j, counters_c, snap_c) in zip(eager.reads, compiled.reads):
        assert i == j
        assert counters_e.keys() == counters_c.keys(), (config, i)
        for key in counters_e:
            assert torch.equal(counters_e[key], counters_c[key]), (config, i, key)
        assert snap_e.keys() == snap_c.keys(), (config, i)
        for key, value in snap_e.items():
            other = snap_c[key]
            same = value == other or (math.isnan(value) and math.isnan(other))
            assert same, (config, i, key, value, other)


@pytest.mark.parametrize("config", CONFIGS)
def test_aot_eager_region_takes_every_eager_decision_bit_for_bit(
    config: str, aot_eager_runs
) -> None:
    eager, compiled = _runs(aot_eager_runs, config)
    assert compiled.scales == eager.scales, config
    assert compiled.applied == eager.applied, config
    for i, (a, b) in enumerate(zip(eager.params, compiled.params, strict=True)):
        assert torch.equal(a, b), (config, i, (a - b).abs().max())
    _assert_same_reads(eager, compiled, config)
    assert eager.final_state.keys() == compiled.final_state.keys()
    for key, value in eager.final_state.items():
        other = compiled.final_state[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), (config, key)
        else:
            assert value == other, (config, key)


@pytest.mark.parametrize("config", CONFIGS)
def test_no_recompile_after_the_warm_up_in_500_iterations(config: str, aot_eager_runs) -> None:
    """The reads between steps included. Negative control:
    test_the_recompile_count_sees_a_per_step_python_int."""
    _, compiled = _runs(aot_eager_runs, config)
    assert _compiled.compiled_calls_after_warmup(compiled) == [], (config, compiled.recompiles_at)


def test_the_recompile_count_sees_a_per_step_python_int() -> None:
    """The counter has teeth: the mistake the probe found (predictive's range iteration as a
    Python int, ``% 16`` in the graph) recompiles after the warm-up and is counted."""

    class Holder:
        iteration = 0

    holder, buf = Holder(), torch.zeros(4)

    def wrong(t: torch.Tensor) -> None:
        t.add_(holder.iteration % 16 == 0)
        holder.iteration += 1

    compiled = torch.compile(wrong, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    recompiles = []
    with _compiled.recompile_log() as log:
        for i in range(8):
            before = len(log.messages)
            compiled(buf)
            recompiles += [i] * (len(log.messages) - before)
    after_warmup = [i for i in recompiles if i >= _compiled.COMPILED_WARMUP]
    assert after_warmup, recompiles


def test_the_scenario_exercises_every_rule_it_claims_to(aot_eager_runs) -> None:
    """The oracle's events happen (on the eager run): skips, back-offs, growth, the hysteresis
    tracker below its refill, the gate's warm-up then a spike skip with a full window, predictive's
    range iterations and a sampled underflow share above 0."""
    dynamic, _ = _runs(aot_eager_runs, "dynamic")
    snaps = [snap for _, _, snap in dynamic.reads]
    assert not all(dynamic.applied)
    assert max(s["backoffs"] for s in snaps) > 0 and max(s["growths"] for s in snaps) > 0
    # hysteresis=2: a single inf step is skipped without a back-off (tracker 2 -> 1)
    assert 1 in {s["hysteresis_tracker"] for s in snaps}

    gate, _ = _runs(aot_eager_runs, "guard_gate")
    gate_snaps = [snap for _, _, snap in gate.reads]
    assert max(s["spike_skipped_steps"] for s in gate_snaps) > 0
    assert max(s["spike_window_values"] for s in gate_snaps) == 32  # the window filled
    assert min(s["spike_window_values"] for s in gate_snaps) < 16  # seen during the warm-up

    predictive, _ = _runs(aot_eager_runs, "predictive")
    pred_snaps = [snap for _, _, snap in predictive.reads]
    assert STEPS > 4 * RANGE_EVERY
    assert any(s["underflow_fraction"] > 0 for s in pred_snaps), pred_snaps
    assert len({s["target_scale"] for s in pred_snaps}) > 2  # the range moved the target


@pytest.mark.parametrize("config", ["dynamic"])
def test_a_state_dict_loaded_mid_run_is_taken_by_the_compiled_region(config: str) -> None:
    """A checkpoint loaded between compiled calls (the state saved after iteration 100, loaded
    before 170): the compiled region goes on from it as eager does, bit for bit, and without a
    recompile (the state is data, not a guard)."""
    eager, compiled = _both(config, "aot_eager", _compiled.LOAD_AT + 10, load=True)
    steps = [snap["steps"] for _, _, snap in eager.reads]
    assert any(b < a for a, b in itertools.pairwise(steps))  # the load went back
    assert compiled.scales == eager.scales
    assert compiled.applied == eager.applied
    assert all(torch.equal(a, b) for a, b in zip(eager.params, compiled.params, strict=True))
    _assert_same_reads(eager, compiled, config)
    assert _compiled.compiled_calls_after_warmup(compiled) == [], compiled.recompiles_at


# ---------------------------------------------------------------- Inductor


def _control_difference(steps: int) -> float:
    """The largest parameter difference between the same SGD compiled by Inductor (no scaler)
    and eager, over ``steps`` iterations: what torch's codegen alone changes."""
    from torch import nn

    diffs = []
    runs = []
    for compiled in (False, True):
        model, opt = _compiled.make_model()

        def plain(opt: torch.optim.Optimizer = opt) -> None:
            with torch.no_grad():
                inspect.unwrap(type(opt).step)(opt)  # past _use_grad's graph_break()

        fn = torch.compile(plain, backend="inductor", fullgraph=True) if compiled else plain
        xs = _compiled._inputs(steps)
        params = []
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            model(xs[i]).pow(2).mean().backward()
            fn()
            params.append(_compiled.flat_params(model))
        runs.append(params)
        assert isinstance(model, nn.Module)
    for a, b in zip(*runs, strict=True):
        diffs.append((a - b).abs().max().item())
    return max(diffs)


@pytest.mark.parametrize("config", ["dynamic"])
def test_inductor_region_takes_the_same_decisions_and_its_params_differ_as_the_control(
    config: str,
) -> None:
    eager, compiled = _both(config, "inductor", INDUCTOR_STEPS)
    assert compiled.scales == eager.scales
    assert compiled.applied == eager.applied
    for (i, counters_e, _), (_, counters_c, _) in zip(eager.reads, compiled.reads, strict=True):
        for key in ("steps", "skipped_steps", "growths", "backoffs", "growth_tracker"):
            assert torch.equal(counters_e[key], counters_c[key]), (i, key)
    assert _compiled.compiled_calls_after_warmup(compiled) == []
    ours = max((a - b).abs().max().item() for a, b in zip(eager.params, compiled.params))
    control = _control_difference(INDUCTOR_STEPS)
    # Within the control's difference (with its own rounding once more for the unscale).
    assert ours <= 2 * control, (ours, control)
