"""A user's GradObserver under a compiled step region: the same events, with the same values,
as around the eager step, through the public API only (``scaler.observing(optimizer)``), and
a scrape after the block (``snapshot(wait=False)``, the exporter's read) reads this update's
values, as after an eager step (before r46b it read one update behind until the next scale()).

The oracle is the same loop run eagerly in the same test. Before ``observing()`` existed (r46b),
the only way was the launcher's: take the observers off ``scaler._observers`` and call them by
hand; the library itself traced the observers' host code into the region.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscale import GradScaler
from dscale.stats import NumericsStats

STEPS = 6
INF_AT = (2,)


class Recorder:
    """Writes down every event with copies of what it was handed."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_grads(self, optimizer: Any, grads: list[torch.Tensor], scale: torch.Tensor) -> None:
        self.events.append(("grads", [g.clone() for g in grads], scale.clone()))

    def on_update(self, scaler: Any, found_inf: torch.Tensor) -> None:
        c = scaler.counters()
        self.events.append(("update", found_inf.clone(), c["scale"].clone(), c["steps"].clone()))


def _run(compiled: bool) -> tuple[list[tuple[Any, ...]], dict[str, Any], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2, sync_free=True)
    recorder = Recorder()
    stats = NumericsStats(model.named_parameters(), underflow_every=2)
    scaler.add_observer(recorder)
    scaler.add_observer(stats)

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    fn = torch.compile(region, fullgraph=True, backend="eager") if compiled else region
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    for i in range(STEPS):
        scaler.scale(model(x).square().mean()).backward()
        if i in INF_AT:
            next(iter(model.parameters())).grad[0, 0] = float("inf")
        with scaler.observing(opt):
            # the first call eager: it creates the optimizer state (the documented warm-up)
            fn() if i else region()
        # what a scrape (the exporter) reads between steps: this update's, as after an eager one
        recorder.events.append(("scrape", scaler.snapshot(wait=False)))
        opt.zero_grad(set_to_none=True)
    values = {k: v.clone() for k, v in stats.device_values().items()}
    return recorder.events, values, torch.cat([p.detach().flatten() for p in model.parameters()])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_observer_sees_the_same_events_compiled_as_eager() -> None:
    eager_events, eager_stats, eager_params = _run(compiled=False)
    events, stats, params = _run(compiled=True)
    kinds = [e[0] for e in events]
    assert kinds == ["grads", "update", "scrape"] * STEPS
    assert [bool(e[1] > 0) for e in eager_events if e[0] == "update"] == [
        i in INF_AT for i in range(STEPS)
    ]
    assert _same(events, eager_events)
    assert _same(stats, eager_stats)
    assert torch.equal(params, eager_params)  # monitoring changed nothing


def test_compiled_step_with_observers_outside_observing_names_the_fix() -> None:
    """Under fullgraph, a step with observers and no observing() block refuses with the fix;
    without fullgraph it runs eagerly, and the observers still hear every event."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    scaler = GradScaler("cpu", sync_free=True)
    recorder = Recorder()
    scaler.add_observer(recorder)

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    x = torch.ones(2, 4)
    scaler.scale(model(x).sum()).backward()
    region()
    scaler.scale(model(x).sum()).backward()
    with pytest.raises(Exception, match=r"scaler\.observing\(optimizer\)"):
        torch.compile(region, fullgraph=True, backend="eager")()
    assert [e[0] for e in recorder.events] == ["grads", "update"]
