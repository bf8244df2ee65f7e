"""``trainer.compile_step=true``: the loop's post-backward region as one compiled program.

The region is ``scaler.step(optimizer)`` then ``scaler.update()``: the inf/NaN check, the one
agreement all-reduce, the decision, the optimizer's step (skipped on the device) and the scale
rule. It is compiled with ``torch.compile(fullgraph=True)`` after ``WARMUP_STEPS`` eager steps,
which create the optimizer's state (docs/compiled-step.md). The demo loop does no gradient
clipping, so nothing else belongs in the region; the fault injection, the loss read and
``zero_grad`` stay outside it, eager, as they are host work or change from step to step.

What the scaler would call back into on the host (its step callbacks and observers: the record
of skipped steps, the metrics log, the numerics stats, the exporter's rank check) cannot run
inside a fullgraph region. While the compiled region runs they are held off the scaler, and this
module calls them around it, eagerly: observers' ``on_grads`` before, the launcher's skip record
and observers' ``on_update`` after, with the same arguments the scaler gives them. Callbacks
other than the record's (``dscale.fp8``'s) are refused before any worker starts
(``launch/validate.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from dscale import GradScaler
from launch.record import SkipRecord

#: Eager steps before the first compiled one: they create the optimizer's state (torchtitan's
#: CUDA-graph warm-up, PR #4433, takes two for the same reason; one is enough without a graph).
WARMUP_STEPS = 1

#: ``trainer.compile_backend`` values: Inductor writes the kernels; aot_eager and eager trace
#: the same region and run torch's ops (compiled faster, for tests and debugging).
BACKENDS = ("inductor", "aot_eager", "eager")


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: FSDP2's grads are DTensors; the scaler sees the shard."""
    return getattr(grad, "_local_tensor", grad)


def _skips(scaler: GradScaler) -> torch.Tensor:
    """Steps skipped so far, overflows and (with the spike gate) spikes: a device tensor."""
    counters = scaler.counters()
    spikes = counters.get("spike_skipped_steps")
    return counters["skipped_steps"] + (0 if spikes is None else spikes)


class CompiledStep:
    """Call once per iteration after backward: ``step(optimizer)`` and ``update()``, compiled.

    Args:
        scaler: the job's ``GradScaler`` or ``StepGuard``.
        optimizer: the one optimizer the region steps.
        record: the launcher's skip record, detached from the scaler's callbacks here and fed
            from the region's outcome instead.
        backend: ``torch.compile``'s backend (``trainer.compile_backend``).
        warmup: eager iterations before the first compiled one.
    """

    def __init__(
        self,
        scaler: GradScaler,
        optimizer: torch.optim.Optimizer,
        record: SkipRecord,
        *,
        backend: str = "inductor",
        warmup: int = WARMUP_STEPS,
    ) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self.record = record
        self._eager_left = warmup
        record.detach()
        self._compiled = torch.compile(self._region, fullgraph=True, backend=backend)

    def _region(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def __call__(self) -> None:
        """One iteration's post-backward work: eager during the warm-up, compiled after it."""
        scaler, optimizer = self.scaler, self.optimizer
        if not scaler.is_enabled():  # nothing to agree on: a plain step
            optimizer.step()
            return
        compiled = self._eager_left <= 0
        self._eager_left -= 1
        with self._held_off() as observers:
            if observers:
                scale = scaler.counters()["scale"]
                grads = [
                    _local(p.grad)
                    for group in optimizer.param_groups
                    for p in group["params"]
                    if p.grad is not None
                ]
                for observer in observers:
                    observer.on_grads(optimizer, grads, scale)
                skipped_before = _skips(scaler).clone()
            if compiled:
                self._compiled()
            else:
                self._region()
        applied = scaler.step_applied(optimizer)  # on the host already on the CPU
        if not applied:
            self.record.record_skip(int(scaler.snapshot()["steps"]) - 1)
        if observers:
            # The flag observers are given: > 0 where the step was skipped (a spike included).
            found = (_skips(scaler) - skipped_before).float()
            for observer in observers:
                observer.on_update(scaler, found)

    @contextlib.contextmanager
    def _held_off(self) -> Iterator[list[Any]]:
        """The scaler's observers, taken off it (and put back) around the region.

        dscale has no public getter for them; this is the one place the launcher reads the
        scaler's lists (``add_observer`` / ``register_step_callback`` fill them).
        """
        scaler: Any = self.scaler
        observers: list[Any] = list(scaler._observers)
        callbacks: list[Any] = list(scaler._callbacks)
        if callbacks:
            raise RuntimeError(
                "trainer.compile_step=true: a step callback is registered on the scaler "
                f"({callbacks[0]!r}); its host work cannot run inside the compiled region. "
                "launch/validate.py refuses the fp8 parts that register one; set "
                "trainer.compile_step=false to use it"
            )
        scaler._observers.clear()
        try:
            yield observers
        finally:
            scaler._observers[:] = observers


def check_compiles(scaler: GradScaler, *, foreach: bool = True) -> None:
    """Compile the region once, here, around a tiny CPU model: the library's own verdict.

    ``launch/validate.py`` calls it in the parent (backend ``eager``: dynamo traces the region
    as every backend would, in about a second), so a scaler configuration that must decide on
    the host fails before any worker starts, with dscale's message naming what compiles.
    Raises whatever ``torch.compile(fullgraph=True)`` raised.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    region = CompiledStep(scaler, optimizer, SkipRecord(), backend="eager")
    with warnings.catch_warnings():  # e.g. "no float16 tensors": this model is not the job's
        warnings.simplefilter("ignore")
        for _ in range(WARMUP_STEPS + 1):
            scaler.scale(model(torch.ones(2, 4)).float().square().mean()).backward()
            region()
            optimizer.zero_grad(set_to_none=True)
