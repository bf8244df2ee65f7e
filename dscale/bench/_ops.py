"""``python -m dscale.bench ops``: what each scaler adds to an iteration, counted per row.

An iteration is ``scale(loss)``, ``step(optimizer)`` and ``update()`` on gradients that are already
there (under DDP: the backward too); the plain optimizer step (and plain backward) is counted
alone on the same state and subtracted, so a row shows the scaler's own ops. Counts are taken in
steady state: after a few warm-up iterations (state created), averaged over 32 iterations, which
covers the agreement vector's period (``dscale.scaler._program.agreement.RANGE_EVERY``).

dscale's arms run its device-side decision, the path a CUDA run takes: on the CPU the scaler would
read the agreed flag on the host for free and decide there, so the benchmark turns that off
through the scaler's seam for it, ``GradScaler._read_host_flags = False`` (see
:func:`force_device_decision`). torch's scalers have one path; they run as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import dscale
from dscale.bench._arms import FLOOR, INIT_SCALE, make_scaler
from dscale.bench._op_count import OpCounts, count_cuda_kernels, count_ops

NUMEL = 64
WARMUP = 4
ITERS = 32
OPTIMIZERS = ("sgd", "adamw", "sgd-stateless", "adamw-frozen")
IMPLS = ("foreach", "fused")
#: Rows with parameters that have no optimizer state: SGD without momentum keeps none, and a
#: frozen parameter (no grad) in AdamW never gets any. ``sync_free`` must keep its flat snapshot
#: for them (issue 33); a fused optimizer never takes that path, so they run foreach only.
WITHOUT_STATE = ("sgd-stateless", "adamw-frozen")
IMPLS_OF = dict.fromkeys(WITHOUT_STATE, ("foreach",))
PARAM_COUNTS = (8, 200)
DSCALE_ARMS = ("dscale", "dscale_sync_free", "dscale_predictive")
PEER_ARMS = ("torch", "sharded", FLOOR)
ARMS = (*DSCALE_ARMS, *PEER_ARMS)


@dataclasses.dataclass(frozen=True)
class Row:
    """One scenario: an optimizer, its implementation and the number of parameters."""

    optimizer: str
    impl: str
    params: int

    @property
    def name(self) -> str:
        return f"{self.optimizer} {self.impl} x{self.params}"


def rows() -> Iterator[Row]:
    for optimizer in OPTIMIZERS:
        for impl in IMPLS_OF.get(optimizer, IMPLS):
            for params in PARAM_COUNTS:
                yield Row(optimizer, impl, params)


def force_device_decision(scaler: dscale.GradScaler) -> None:
    """Make ``scaler`` decide fused and ``sync_free`` steps on the device, as on CUDA.

    The seam: on the CPU the agreed flag is in host memory, so the scaler reads it and decides on
    the host (free there); a CUDA run cannot, and runs the device-side update instead. Tests and
    this benchmark turn the host read off to count and check that path without a GPU.
    """
    scaler._read_host_flags = False


def make_optimizer(params: list[nn.Parameter], row: Row) -> torch.optim.Optimizer:
    flags: dict[str, Any] = {"foreach": True} if row.impl == "foreach" else {"fused": True}
    if row.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-6, momentum=0.9, **flags)
    if row.optimizer == "sgd-stateless":
        return torch.optim.SGD(params, lr=1e-6, **flags)
    if row.optimizer == "adamw-frozen":  # one more parameter, frozen: no grad, never any state
        frozen = nn.Parameter(torch.zeros(NUMEL, device=params[0].device), requires_grad=False)
        return torch.optim.AdamW([params[0], frozen, *params[1:]], lr=1e-6, **flags)
    return torch.optim.AdamW(params, lr=1e-6, **flags)


def make_arm(arm: str, device: torch.device, group: Any = None) -> Any:
    """A scaler by arm name, its scale placed on ``device``."""
    if arm not in DSCALE_ARMS:
        return make_scaler(arm, device)
    scaler = dscale.GradScaler(
        device.type,
        init_scale=INIT_SCALE,
        sync_free=arm == "dscale_sync_free",
        policy="predictive" if arm == "dscale_predictive" else "dynamic",
        process_group=group,
    )
    force_device_decision(scaler)
    scaler.scale(torch.ones((), device=device))
    return scaler


class _Setup:
    """Parameters with saved grads of a moderate size, put back before every iteration."""

    def __init__(self, row: Row, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.params = [
            nn.Parameter(torch.randn(NUMEL, generator=gen).to(device)) for _ in range(row.params)
        ]
        self.saved = [torch.randn(NUMEL, generator=gen).to(device) * 64 for _ in self.params]
        self.loss = torch.ones((), device=device)

    def load_grads(self) -> None:
        for param, grad in zip(self.params, self.saved, strict=True):
            param.grad = grad.clone()


def _steady_state(
    setup: _Setup,
    iteration: Callable[[], object],
    plain: Callable[[], object],
    counter: Callable[[Callable[[], object]], Any],
) -> tuple[list[Any], Any]:
    """``counter`` of ITERS iterations after WARMUP ones, and of the plain step alone."""
    for _ in range(WARMUP):
        setup.load_grads()
        iteration()
    counted = []
    for _ in range(ITERS):
        setup.load_grads()
        counted.append(counter(iteration))
    setup.load_grads()
    return counted, counter(plain)


def _mean(counted: list[OpCounts]) -> dict[str, Any]:
    total = OpCounts()
    for counts in counted:
        total = total + counts
    return total.scaled(1 / len(counted))


def own_per_iteration(counted: list[OpCounts], plain: list[OpCounts]) -> dict[str, Any]:
    """The mean of ``counted`` minus that of ``plain``, per iteration, with the ops by name."""
    mine, theirs = _mean(counted), _mean(plain)
    out: dict[str, Any] = {
        key: round(mine[key] - theirs[key], 3) for key in ("kernels", "host_reads", "collectives")
    }
    names = sorted(set(mine["by_op"]) | set(theirs["by_op"]))
    by_op = {n: round(mine["by_op"].get(n, 0) - theirs["by_op"].get(n, 0), 3) for n in names}
    out["by_op"] = {name: value for name, value in by_op.items() if value}
    return out


def measure(arm: str, row: Row, device: torch.device, *, profile: bool = False) -> dict[str, Any]:
    """The scaler's own ops per iteration for ``arm`` on ``row`` (and CUDA kernels if asked)."""
    setup = _Setup(row, device)
    optimizer = make_optimizer(setup.params, row)
    scaler = make_arm(arm, device)

    def iteration() -> None:
        scaler.scale(setup.loss)
        scaler.step(optimizer)
        scaler.update()

    counter = functools.partial(count_ops, host_only=device.type == "cpu")
    counted, plain = _steady_state(setup, iteration, optimizer.step, counter)
    result = own_per_iteration(counted, [plain])
    if profile:
        kernels, plain_kernels = _steady_state(setup, iteration, optimizer.step, count_cuda_kernels)
        result["cuda_kernels"] = round(sum(kernels) / len(kernels) - plain_kernels, 3)
    return result


class _Summed(nn.Module):
    """``count`` parameters of NUMEL elements whose grads are ``x`` times a fixed weight."""

    def __init__(self, count: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(NUMEL, generator=gen)) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w * x).sum() for w in self.weights]).sum()


def measure_attached(arm: str, row: Row, group: Any) -> dict[str, Any]:
    """``arm`` with ``attach()`` on a DDP model: step and update after an attached backward.

    The hook's own work (unscale and check of each bucket as it is reduced, a fixed handful of
    ops per DDP bucket, whatever the parameter count) runs in DDP's reduction, partly on gloo's
    threads, where a thread-local count cannot follow it; what is counted here is what the
    scaler still does in step() and update() with the hook's flag in hand, minus the plain step.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.full((NUMEL,), 1.0 / 64)
    model = DDP(_Summed(row.params))
    optimizer = make_optimizer(list(model.parameters()), row)
    scaler = make_arm(arm, torch.device("cpu"), group)
    scaler.attach(model)

    def backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(x)).backward()

    def step() -> None:
        scaler.step(optimizer)
        scaler.update()

    counted: list[OpCounts] = []
    for i in range(WARMUP + ITERS):
        backward()
        if i < WARMUP:
            step()
        else:
            counted.append(count_ops(step, host_only=True))
    backward()
    plain = count_ops(optimizer.step, host_only=True)
    return own_per_iteration(counted, [plain])
