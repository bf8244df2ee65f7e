"""Fields registered on the agreement vector each read their own agreed values (issue 34).

``GradScaler.add_agreement_field`` once handed each field the vector its own ``append_to``
returned: with two fields, the first kept a vector that the second's append had copied, so it
read its rank-local values, never the MAX over the ranks (dscale.fp8 chained its fields to work
around it). Each field now gets its own slots in the vector that is all-reduced. Checked on 2
ranks against the MAX computed by hand, alongside the scaler's own fields (predictive's
measurement, the spike gate's slots, the scale range on and off its iteration), with a field
that sends nothing on some steps, and on a step where an overflow skips: the step's decision and
the scale equal those of the same scaler with no fields.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dscale
from tests.multirank import run_ranks


class _Field:
    """Sends ``[base * (rank + 1), -base * rank]`` (or nothing on odd steps if ``sparse``)."""

    def __init__(self, rank: int, base: float, sparse: bool = False) -> None:
        self.rank, self.base, self.sparse = rank, base, sparse
        self.step = 0
        self.slots: torch.Tensor | None = None
        self.read: list[list[float] | None] = []

    def values(self, optimizer: Any) -> torch.Tensor | None:
        if self.sparse and self.step % 2:
            return None
        return torch.tensor([self.base * (self.rank + 1), -self.base * self.rank])

    def agreed(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def after_step(self, optimizer: Any, applied: bool) -> None:
        self.read.append(None if self.slots is None else self.slots.tolist())
        self.slots = None
        self.step += 1


def _run(rank: int, make: Any, with_fields: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make()
    fields = [_Field(rank, 3.0), _Field(rank, 5.0, sparse=True), _Field(rank, 7.0)]
    if with_fields:
        for field in fields:
            scaler.add_agreement_field(field)
            scaler.register_step_callback(field.after_step)
    applied, scales = [], []
    for step in range(20):  # past the scale range's iteration (every 16th)
        opt.zero_grad()
        poison = float("inf") if (step == 5 and rank == 1) else 1.0
        loss = model(torch.full((3, 4), 0.5 + step)).square().mean() * poison
        scaler.scale(loss).backward()
        scaler.step(opt)
        applied.append(scaler.step_applied(opt))
        scaler.update()
        scales.append(scaler.get_scale())
    return {
        "read": [f.read for f in fields],
        "applied": applied,
        "scales": scales,
        "weight": model.weight.detach().clone(),
    }


_SCALERS = {
    "dynamic": lambda: dscale.GradScaler("cpu", init_scale=2.0**8, growth_interval=3),
    "predictive": lambda: dscale.GradScaler("cpu", policy="predictive"),
    "spike_gate": lambda: dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm")),
}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    return {
        name: {"fields": _run(rank, make, True), "plain": _run(rank, make, False)}
        for name, make in _SCALERS.items()
    }


def _both(rank: int, world: int) -> dict[str, Any]:
    return {"scenarios": _scenarios(rank, world), "attached": _attached_fields(rank, world)}


@pytest.fixture(scope="module")
def spawned() -> dict[int, dict[str, Any]]:
    """One 2-rank spawn for both tests below (a spawn costs seconds)."""
    return run_ranks(_both, world_size=2)


def test_each_registered_field_reads_the_max_over_the_ranks_and_changes_no_decision(spawned):
    results = {rank: out["scenarios"] for rank, out in spawned.items()}
    for rank, per_scaler in results.items():
        for name, got in per_scaler.items():
            first, sparse, last = got["fields"]["read"]
            assert first == [[6.0, 0.0]] * 20, (rank, name)  # max(3, 6), max(0, -3)
            assert last == [[14.0, 0.0]] * 20, (rank, name)
            assert sparse == [[10.0, 0.0] if s % 2 == 0 else None for s in range(20)], (rank, name)
            plain = got["plain"]
            assert got["fields"]["applied"] == plain["applied"], (rank, name)
            assert got["fields"]["scales"] == plain["scales"], (rank, name)
            assert torch.equal(got["fields"]["weight"], plain["weight"]), (rank, name)
            assert plain["applied"][5] is False  # the overflow on rank 1 skipped both ranks


def test_fields_are_asked_for_their_values_before_the_spike_gate_reads_the_grads() -> None:
    """The order observers and fields see, as at 0010076: the grads' observers, then each field's
    values() in registration order, then the spike gate's tail (the vector's order). 1db0beb ran
    the gate first, so a gate that raised (no loss given to scale()) left the fields unasked."""
    calls: list[str] = []

    class Logged:
        def __init__(self, name: str) -> None:
            self.name = name

        def values(self, optimizer: Any) -> torch.Tensor:
            calls.append(f"values {self.name}")
            return torch.ones(1)

        def agreed(self, slots: torch.Tensor) -> None:
            calls.append(f"agreed {self.name}")

    class Observer:
        def on_grads(self, optimizer: Any, grads: Any, scale: torch.Tensor) -> None:
            calls.append("on_grads")

        def on_update(self, scaler: Any, found: Any) -> None:
            calls.append("on_update")

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = dscale.StepGuard("cpu", spike_signals=("loss",))
    guard.add_observer(Observer())
    for name in ("a", "b"):
        guard.add_agreement_field(Logged(name))
    gate = guard._spike
    tail = gate.tail

    def logged_tail(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("spike tail")
        return tail(*args, **kwargs)

    gate.tail = logged_tail
    guard.scale(model(torch.ones(3, 4)).sum()).backward()
    guard.step(opt)
    guard.update()
    assert calls == [
        "on_grads",
        "values a",
        "values b",
        "spike tail",
        "agreed a",
        "agreed b",
        "on_update",
    ]
    calls.clear()
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()  # no loss given to scale(): the gate raises
    with pytest.raises(RuntimeError, match="no loss was passed to scale"):
        guard.step(opt)
    assert calls == ["on_grads", "values a", "values b", "spike tail"]


class _LocalField:
    """Sends this rank's own number per step (NaN from rank 1 on step 2), as dscale.fp8's
    Float8Numerics sends the activations' amaxes, which differ by rank under DDP."""

    def __init__(self, rank: int) -> None:
        self.rank, self.step = rank, 0
        self.slots: torch.Tensor | None = None
        self.read: list[list[float] | None] = []

    def values(self, optimizer: Any) -> torch.Tensor:
        if self.rank == 1 and self.step == 2:
            return torch.tensor([float("nan"), -1.0])
        return torch.tensor([float(self.rank + self.step), -float(self.rank)])

    def agreed(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def after_step(self, optimizer: Any, applied: bool) -> None:
        self.read.append(None if self.slots is None else self.slots.tolist())
        self.slots = None


def _attached_fields(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.scaler._setup import batch, tiny_model

    out: dict[str, Any] = {}
    for name in ("attach", "plain", "attach_refused", "attach_backward_since_unscale"):
        model = DDP(tiny_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
        field = _LocalField(rank)
        scaler.add_agreement_field(field)
        scaler.register_step_callback(field.after_step)
        if name != "plain":
            scaler.attach(model)
        applied, errors = [], []
        for step in range(4):
            field.step = step
            opt.zero_grad()
            scaler.scale(model(batch(rank, step)).square().mean()).backward()
            if name == "attach_refused" and step == 1 and rank == 1:
                model.module[0].weight.grad.mul_(0.5)  # written after the hooks checked it
            if name == "attach_backward_since_unscale":
                scaler.unscale_(opt)  # the agreement waits for the flag's first read
                if step == 1 and rank == 1:  # a backward outside the reduction, rank 1 only
                    scaler.scale(model.module(batch(rank, 9)).sum()).backward()
            try:
                scaler.step(opt)
                applied.append(scaler.step_applied(opt))
            except RuntimeError as exc:
                errors.append(str(exc)[:40])
                applied.append(None)
            try:
                scaler.update()
            except RuntimeError as exc:  # without the collective: "the ranks' weights may differ"
                errors.append(str(exc)[:40])
        out[name] = {"read": field.read, "applied": applied, "errors": errors}
    return out


def test_registered_fields_read_the_max_over_the_ranks_under_attach(spawned) -> None:
    """Under attach() DDP's reduction makes the overflow flag global, so the scaler dropped its
    collective: a registered field then read its rank-local values (rank 0 read 0, 1, 2, 3
    where the MAX is 1, 2, inf, 4), and Float8Numerics' amaxes differed by rank. Registered fields
    keep the collective (as the spike gate does), and a rank that refuses its step (a grad
    written after the hooks; a backward after unscale_()) joins it, so that its peer skips
    instead of stepping alone. Oracle: the same run without attach()."""
    results = {rank: out["attached"] for rank, out in spawned.items()}
    want = [[1.0, 0.0], [2.0, 0.0], [float("inf"), 0.0], [4.0, 0.0]]
    for rank, got in results.items():
        assert got["plain"]["read"] == want, rank
        assert got["attach"]["read"] == want, rank
        assert got["attach"]["applied"] == got["plain"]["applied"] == [True] * 4, rank
    refused = [results[r]["attach_refused"] for r in (0, 1)]
    assert refused[0] == {"read": want, "applied": [True, False, True, True], "errors": []}
    assert refused[1]["applied"] == [True, None, True, True]
    assert len(refused[1]["errors"]) == 1 and refused[1]["errors"][0].startswith("attach(): ")
    assert refused[1]["read"] == [want[0], want[2], want[3]]  # no step callback when refused
    # The same after unscale_(), for a backward on rank 1 alone: it joins the deferred agreement.
    since = [results[r]["attach_backward_since_unscale"] for r in (0, 1)]
    assert since[0] == refused[0]
    assert since[1]["applied"] == [True, None, True, True]
    assert len(since[1]["errors"]) == 1 and since[1]["errors"][0].startswith("attach(): ")
    assert since[1]["read"] == [want[0], want[2], want[3]]
