"""``trainer.compile_step=true``: the loop's post-backward region as one compiled program.

The region is ``scaler.step(optimizer)`` then ``scaler.update()``: the inf/NaN check, the one
agreement all-reduce, the decision, the optimizer's step (skipped on the device) and the scale
rule. It is compiled with ``torch.compile(fullgraph=True)`` after ``WARMUP_STEPS`` eager steps,
which create the optimizer's state (docs/compiled-step.md). The demo loop does no gradient
clipping, so nothing else belongs in the region; the fault injection, the loss read and
``zero_grad`` stay outside it, eager, as they are host work or change from step to step.

What the scaler would call back into on the host cannot run inside a fullgraph region. Its
observers (the metrics log, the numerics stats, the exporter's rank check) run eagerly around it
through dscale's public ``scaler.observing(optimizer)``: ``on_grads`` before the region,
``on_update`` after it, with what the eager step gives them. The launcher's skip record is a step
callback; it is detached here and fed from ``scaler.step_applied()`` after the region. Callbacks
other than the record's (``dscale.fp8``'s) are refused before any worker starts
(``launch/validate.py``); a compiled step with a callback names them in torch's error.
"""

from __future__ import annotations

import warnings

import torch

from dscale import GradScaler
from launch.record import SkipRecord

#: Eager steps before the first compiled one: they create the optimizer's state (torchtitan's
#: CUDA-graph warm-up, PR #4433, takes two for the same reason; one is enough without a graph).
WARMUP_STEPS = 1

#: ``trainer.compile_backend`` values: Inductor writes the kernels; aot_eager and eager trace
#: the same region and run torch's ops (compiled faster, for tests and debugging).
BACKENDS = ("inductor", "aot_eager", "eager")


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter of ``optimizer`` has its state (made by a step, or loaded)."""
    state = optimizer.state
    return all(bool(state.get(p)) for group in optimizer.param_groups for p in group["params"])


class CompiledStep:
    """Call once per iteration after backward: ``step(optimizer)`` and ``update()``, compiled.

    Args:
        scaler: the job's ``GradScaler`` or ``StepGuard``.
        optimizer: the one optimizer the region steps.
        record: the launcher's skip record, detached from the scaler's callbacks here and fed
            from the region's outcome instead.
        backend: ``torch.compile``'s backend (``trainer.compile_backend``).
        warmup: eager iterations before the first compiled one, while the optimizer has no
            state (none after a resume, which loaded it).
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
        # The warm-up only creates the optimizer's state: a resumed job loaded it, and an eager
        # step there would differ from the uninterrupted job's compiled one in the last bits.
        compiled = self._eager_left <= 0 or _has_state(optimizer)
        self._eager_left -= 1
        with scaler.observing(optimizer):
            if compiled:
                self._compiled()
            else:
                self._region()
        if not scaler.step_applied(optimizer):  # on the host already on the CPU
            self.record.record_skip(int(scaler.snapshot()["steps"]) - 1)


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
