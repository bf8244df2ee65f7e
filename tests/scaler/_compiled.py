"""The compiled step's oracle harness: one training run, eager or with the region compiled.

The region is what issue 46 compiles: ``scaler.step(optimizer)`` and ``scaler.update()`` after an
eager backward, as one ``torch.compile(fullgraph=True)`` function, after eager warm-up steps that
create the optimizer's state. :func:`run` trains a small model for ``steps`` iterations with the
same injected events in either arm (infs in one grad, loss spikes, steps whose grads underflow in
fp16, a ``load_state_dict`` of an earlier state mid-run, ``counters()`` / ``snapshot()`` reads
between steps) and records everything the two arms must agree on, bit for bit under ``aot_eager``.

Recompiles are counted with torch's own recompile logging (the ``recompiles`` artifact of
``torch._dynamo``), step by step, so a test can say which step recompiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import dscale
from dscale.bench._ops import force_device_decision

#: Eager iterations before the compiled region takes over (they create the momentum buffers).
EAGER_WARMUP = 2
#: Compiled calls allowed to (re)compile: the first compile, and one for what the eager warm-up
#: left different from the steady state (the notes' "one recompile left by the eager warm-up").
COMPILED_WARMUP = 2

# Events, by iteration (the same in every arm and every config).
INF_STEPS = frozenset({5, 40, 41, 90, 91, 92, 150, 151, 230, 231, 232, 233, 260, 310, 311, 420})
SPIKE_STEPS = frozenset({120, 121, 200, 330, 450})  # loss x 1e3: the gate's target
UNDERFLOW_STEPS = frozenset(range(60, 75))  # inputs x 1e-9: grads below fp16's smallest
SAVE_AT, LOAD_AT = 100, 170  # state_dict() saved after iteration 100, loaded before 170
READ_EVERY = 7  # counters() and snapshot() between iterations

#: What compiles fullgraph: every decision on the device (``sync_free=True``, foreach optimizer).
CONFIGS: dict[str, Callable[[], dscale.GradScaler]] = {
    # sync_free with the dynamic rule, hysteresis and both bounds.
    "dynamic": lambda: dscale.GradScaler(
        "cpu",
        init_scale=2.0**12,
        growth_interval=6,
        hysteresis=2,
        min_scale=2.0**-4,
        max_scale=2.0**16,
        sync_free=True,
    ),
    "predictive": lambda: dscale.GradScaler(
        "cpu", init_scale=2.0**12, policy="predictive", sync_free=True
    ),
    "guard_gate": lambda: dscale.StepGuard(
        "cpu", spike_signals=("loss", "grad_norm"), spike_window=32, spike_warmup=16, sync_free=True
    ),
}


def make_scaler(config: str) -> dscale.GradScaler:
    scaler = CONFIGS[config]()
    force_device_decision(scaler)
    return scaler


# ---------------------------------------------------------------- recompiles


class RecompileLog(logging.Handler):
    """Counts dynamo's "Recompiling function ..." records (torch's ``recompiles`` artifact)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Recompiling function" in message:
            self.messages.append(message)


@contextlib.contextmanager
def recompile_log() -> Iterator[RecompileLog]:
    """torch's recompile logging turned on, its records counted by the yielded handler."""
    from torch._dynamo import guards

    handler = RecompileLog()
    logger = guards.recompiles_log
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # counted here, not printed
    try:
        yield handler
    finally:
        logger.propagate = propagate
        logger.removeHandler(handler)
        torch._logging.set_logs()


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class Record:
    """What one run saw, per iteration, and what it read between iterations."""

    scales: list[float] = dataclasses.field(default_factory=list)
    applied: list[bool] = dataclasses.field(default_factory=list)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    reads: list[tuple[int, dict[str, Any], dict[str, float | int]]] = dataclasses.field(
        default_factory=list
    )
    recompiles_at: list[int] = dataclasses.field(default_factory=list)
    final_state: dict[str, Any] = dataclasses.field(default_factory=dict)


def _inputs(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 8, generator=gen) for _ in range(steps)]
    for i in UNDERFLOW_STEPS:
        if i < steps:
            xs[i] = xs[i] * 1e-9
    return xs


def make_model(rank: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A two-layer model and SGD foreach with momentum (bitwise equal compiled under aot_eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
    return model, opt


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def run(
    config: str,
    backend: str | None,
    *,
    steps: int = 300,
    rank: int = 0,
    inf_rank: int | None = None,
    events: bool = True,
    load: bool = False,
) -> Record:
    """Train ``steps`` iterations of ``config``; compile the region with ``backend`` (None: eager).

    ``inf_rank``: on several ranks, only this rank puts the infs into its grad (None: every rank).
    ``events=False`` runs without the reads between iterations; ``load=True`` loads the state
    saved after iteration SAVE_AT before iteration LOAD_AT.
    """
    model, opt = make_model()
    scaler = make_scaler(config)

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    compiled = region if backend is None else torch.compile(region, backend=backend, fullgraph=True)
    record = Record()
    saved: dict[str, Any] | None = None
    xs = _inputs(steps)
    torch._dynamo.reset()
    with recompile_log() as log:
        for i in range(steps):
            if load and i == LOAD_AT and saved is not None:
                scaler.load_state_dict(saved)
            opt.zero_grad(set_to_none=True)
            loss = model(xs[i]).pow(2).mean()
            if i in SPIKE_STEPS:
                loss = loss * 1e3
            scaler.scale(loss).backward()
            if i in INF_STEPS and (inf_rank is None or rank == inf_rank):
                next(iter(model.parameters())).grad[0, 0] = float("inf")  # type: ignore[index]
            before = len(log.messages)
            try:
                (region if i < EAGER_WARMUP else compiled)()
            except Exception as exc:
                raise AssertionError(f"{config}: iteration {i} ({backend}) raised") from exc
            record.recompiles_at += [i] * (len(log.messages) - before)
            record.scales.append(scaler.get_scale())
            record.applied.append(scaler.step_applied(opt))
            record.params.append(flat_params(model))
            if events and i % READ_EVERY == 0:
                counters = {k: v.clone() for k, v in scaler.counters().items()}
                record.reads.append((i, counters, scaler.snapshot()))
            if load and i == SAVE_AT:
                saved = scaler.state_dict()
    record.final_state = scaler.state_dict()
    return record


def compiled_calls_after_warmup(record: Record) -> list[int]:
    """The iterations that recompiled after the warm-up (eager steps + the first compiled calls)."""
    return [i for i in record.recompiles_at if i >= EAGER_WARMUP + COMPILED_WARMUP]
