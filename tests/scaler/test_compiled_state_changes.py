"""Issue 46 review (r46a): the scaler's state changed eagerly between compiled calls.

``scaler.step(opt); scaler.update()`` compiled with ``fullgraph=True`` (aot_eager) after two eager
warm-up steps, while the loop changes the state between compiled calls, eagerly:
``load_state_dict`` (a dict saved eagerly before, and one saved between compiled calls) three
times, ``update(new_scale=float)`` and ``update(new_scale=tensor)``; ``snapshot()`` and
``state_dict()`` read after every step. The oracle is the same loop run eagerly: every scale,
snapshot, state dict and parameter must be equal bit for bit, and the loads must not recompile
the region. policy="predictive" saves its rings as eager does (compiled updates turn the device
rings under fixed positions; the saved form turns the positions), and an eager iteration between
compiled ones (update(new_scale=...)) keeps the sampling phase's tensor. Before (2a7fd9e): a
load put the state back on the host and the next compiled call traced the loaded numbers into a
new graph, one recompile per load (after eight, torch's recompile limit), on top of the
recompile at the second compiled call (the warm-up's state form; graphs 3 != 1);
predictive's state dict after compiled steps held the rings rotated (another
`_predictive_window_pos` than eager's); the eager new_scale iteration dropped the sampling
phase (one more recompile) and left `iteration` behind the compiled iterations.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

import dscale

STEPS = 32
WARM_UP = 2
INF_EVERY = 7  # an inf at steps 5, 12, 19, 26: skips and back-offs
SAVE_AT = (6, 12)
LOAD_AT = {9: 6, 15: 12, 21: 6}  # step: the step whose saved dict is loaded after it
NEW_SCALE_AT = {24: 300.0, 28: "tensor"}


MAKERS = {
    "dynamic": lambda: dscale.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=3, sync_free=True
    ),
    "predictive": lambda: dscale.GradScaler(
        "cpu", growth_interval=4, sync_free=True, policy="predictive", predictive_window=4
    ),
}


def _train(name: str, compiled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    scaler = MAKERS[name]()

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    graphs: list[int] = []
    call = region
    if compiled:
        torch._dynamo.reset()
        aot_eager = lookup_backend("aot_eager")

        def backend(gm: Any, example: Any) -> Any:
            graphs.append(1)
            return aot_eager(gm, example)

        call = torch.compile(region, backend=backend, fullgraph=True)
    saved: dict[int, dict[str, Any]] = {}
    trace = []
    for i in range(STEPS):
        x = torch.linspace(-1.0, 1.0, 24).reshape(4, 6) * (1 + i % 3)
        scaler.scale(model(x).square().mean()).backward()
        if i % INF_EVERY == 5:
            model[0].weight.grad[1, 2] = math.inf
        (region if i < WARM_UP else call)()
        opt.zero_grad()
        if i in SAVE_AT:
            saved[i] = scaler.state_dict()
        if i in LOAD_AT:
            scaler.load_state_dict(saved[LOAD_AT[i]])
        if i in NEW_SCALE_AT:
            value = NEW_SCALE_AT[i]
            scaler.update(new_scale=torch.tensor(700.0) if value == "tensor" else value)
        trace.append((scaler.get_scale(), scaler.snapshot(), scaler.state_dict()))
    return {
        "trace": trace,
        "params": [p.detach().clone() for p in model.parameters()],
        "graphs": len(graphs),
    }


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_state_changed_between_compiled_calls_equals_eager_without_recompiling(name: str) -> None:
    """Loads and new scales between compiled calls: eager's results (predictive's saved rings
    included, in eager's positions), and no graph per load."""
    eager = _train(name, False)
    compiled = _train(name, True)
    torch._dynamo.reset()
    for i, (a, b) in enumerate(zip(compiled["trace"], eager["trace"], strict=True)):
        assert a == b, i
    for a, b in zip(compiled["params"], eager["params"], strict=True):
        assert torch.equal(a, b)
    assert eager["trace"][-1][1]["skipped_steps"] > 0  # the scenario did skip
    # One graph: the first compiled call finds the state in its compiled form already (moved
    # when the compilation started), and the loads and new scales keep it there.
    assert compiled["graphs"] == 1


def _checkpointed(directory: str, compiled: bool) -> dict[str, Any]:
    """16 iterations; dscale.checkpoint saves after step 5 and loads it back after step 10."""
    from dscale.checkpoint import CheckpointManager, load_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    scaler = MAKERS["predictive"]()

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    graphs: list[int] = []
    call = region
    if compiled:
        torch._dynamo.reset()
        aot_eager = lookup_backend("aot_eager")

        def backend(gm: Any, example: Any) -> Any:
            graphs.append(1)
            return aot_eager(gm, example)

        call = torch.compile(region, backend=backend, fullgraph=True)
    manager = CheckpointManager(directory, every=0, keep=1)
    trace = []
    for i in range(16):
        x = torch.linspace(-1.0, 1.0, 24).reshape(4, 6) * (1 + i % 3)
        scaler.scale(model(x).square().mean()).backward()
        if i % INF_EVERY == 5:
            model[0].weight.grad[1, 2] = math.inf
        (region if i < WARM_UP else call)()
        opt.zero_grad()
        if i == 5:
            manager.save(6, model=model, optimizer=opt, scaler=scaler)
        if i == 10:
            load_checkpoint(f"{directory}/step-6", model=model, optimizer=opt, scaler=scaler)
        trace.append(repr((scaler.get_scale(), scaler.snapshot(), scaler.state_dict())))
    params = [p.detach().clone() for p in model.parameters()]
    return {"trace": trace, "params": params, "graphs": len(graphs)}


def test_a_checkpoint_loaded_mid_run_continues_compiled_as_eager(tmp_path: Any) -> None:
    """dscale.checkpoint (model, optimizer, predictive scaler) loaded between compiled calls:
    the compiled run goes on as the eager one, bit for bit, in the one graph."""
    eager = _checkpointed(str(tmp_path / "eager"), False)
    compiled = _checkpointed(str(tmp_path / "compiled"), True)
    torch._dynamo.reset()
    assert compiled["trace"] == eager["trace"]
    for a, b in zip(compiled["params"], eager["params"], strict=True):
        assert torch.equal(a, b)
    assert compiled["graphs"] == 1


def _two_optimizers(mode: str | None) -> dict[str, Any]:
    """Two SGDs over the two layers, infs in either; ``mode``: None (eager), "both" (both
    steps in the fullgraph region), "one" (the first stepped eagerly, then the region without
    fullgraph)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    first = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9, foreach=True)
    second = torch.optim.SGD(model[2].parameters(), lr=0.03, momentum=0.5, foreach=True)
    scaler = MAKERS["dynamic"]()
    inside = [first, second] if mode != "one" else [second]

    def region() -> None:
        for opt in inside:
            scaler.step(opt)
        scaler.update()

    graphs: list[int] = []
    call = region
    if mode is not None:
        torch._dynamo.reset()
        aot_eager = lookup_backend("aot_eager")

        def backend(gm: Any, example: Any) -> Any:
            graphs.append(1)
            return aot_eager(gm, example)

        call = torch.compile(region, backend=backend, fullgraph=mode == "both")
    trace = []
    for i in range(12):
        x = torch.linspace(-1.0, 1.0, 24).reshape(4, 6) * (1 + i % 3)
        scaler.scale(model(x).square().mean()).backward()
        if i in (4, 9):
            model[i % 2 * 2].weight.grad[0, 1] = math.inf  # the first layer, then the second
        if mode == "one":
            scaler.step(first)
        (region if i < WARM_UP else call)()
        first.zero_grad()
        second.zero_grad()
        trace.append((scaler.get_scale(), scaler.snapshot()))
    params = [p.detach().clone() for p in model.parameters()]
    return {"trace": trace, "params": params, "graphs": len(graphs)}


def test_two_optimizers_in_the_region_or_one_eager_equal_eager() -> None:
    """Both steps in a fullgraph region: one graph, eager's results; one stepped eagerly
    before the region: update() runs eagerly (a graph break, named under fullgraph), with
    eager's results."""
    eager = _two_optimizers(None)
    both = _two_optimizers("both")
    one = _two_optimizers("one")
    torch._dynamo.reset()
    assert eager["trace"][-1][1]["skipped_steps"] == 2
    for run in (both, one):
        assert run["trace"] == eager["trace"]
        for a, b in zip(run["params"], eager["params"], strict=True):
            assert torch.equal(a, b)
    assert both["graphs"] == 1
