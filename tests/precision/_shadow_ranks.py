"""Runs of ShadowNumerics on the FP8 test model, one process or inside a rank (DDP).

The model: tests/fp8/_models.net() with its four block linears converted to torchao's float8
(tensorwise, emulated) and its head (32 -> 10, a dim torchao cannot take) left an nn.Linear:
the shadow measures layers in FP8 and in high precision alike, under bf16 autocast.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from dscale.bench._op_count import count_ops
from dscale.fp8._layers import LayoutMismatchError
from dscale.precision import ShadowNumerics
from tests.fp8 import _models

LAYER = "head"  # where an outlier goes: the last layer, so no other layer's forward sees it
FP8_LAYER = "blocks.1.fc2"  # a layer in FP8, whose tensors are kept too
OUTLIER_AT = (1, 20)  # (token row of the flattened input, feature)


def run(
    rank: int,
    *,
    every: int | None = 2,
    steps: int = 3,
    outlier_step: int | None = None,
    ddp: bool = False,
    count: bool = False,
    serve: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` (batches of 2 x 16 tokens); return snapshots after sampled steps, the
    tensors ``LAYER`` and ``FP8_LAYER`` saw at the last sampled step, and per step the counted
    kernels and host reads (dscale.bench._op_count) when ``count``."""
    model = _models.net()
    fp8.convert_to_float8(model, recipe="tensorwise", emulate=True)
    layer = model.get_submodule(LAYER)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    shadow = ShadowNumerics(model, guard, every=every) if every else None
    seen: dict[str, dict[str, torch.Tensor]] = {}
    step_now = [0]

    def blow_up(module: nn.Module, args: tuple[Any, ...]) -> Any:
        if step_now[0] == outlier_step and rank == 1:
            x = args[0].clone()
            x.view(-1, x.shape[-1])[OUTLIER_AT] *= 1e6
            return (x,)
        return None

    def capture(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            mine = seen.setdefault(name, {})
            mine["input"] = args[0].detach().clone()
            mine["weight"] = module.weight.detach().clone()
            output.register_hook(lambda g: mine.__setitem__("grad_output", g.detach().clone()))

        return hook

    layer.register_forward_pre_hook(blow_up)
    if not count:
        for name in (LAYER, FP8_LAYER):
            _models_module(model).get_submodule(name).register_forward_hook(capture(name))
    out: dict[str, Any] = {"snapshots": {}, "windows": {}, "counts": [], "seen": {}}
    for step in range(steps):
        step_now[0] = step
        tokens, target = _models.batch(step, rank, size=2)

        def one(tokens: torch.Tensor = tokens, target: torch.Tensor = target) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _models.loss_of(model, tokens, target)
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()

        if count:
            counts = count_ops(one)
            out["counts"].append((counts.num_kernels, counts.host_reads, counts.collectives))
        else:
            one()
        if shadow is not None and shadow.sampled_last_step:
            out["snapshots"][step] = shadow.snapshot()
            out["windows"][step] = shadow.window()
            out["seen"] = {k: {t: v.clone() for t, v in d.items()} for k, d in seen.items()}
    if shadow is not None:
        out["dims"] = shadow.dims
        if serve:
            from prometheus_client import CollectorRegistry, generate_latest

            from dscale.precision._collector import AttachedShadowCollector

            registry = CollectorRegistry()
            registry.register(AttachedShadowCollector(guard, {"rank": str(rank)}))
            out["served"] = generate_latest(registry).decode()
        shadow.close()
    return out


def _models_module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Under DDP: a clean run, one with an outlier on rank 1 at step 2, and a layout mismatch
    (rank 1 measures one layer fewer) and an unknown layer name on rank 1, each of which must
    raise on both ranks."""
    out: dict[str, Any] = {"clean": run(rank, ddp=True), "hit": run(rank, ddp=True, outlier_step=2)}
    model = _models.net()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        ShadowNumerics(model, dscale.StepGuard("cpu"), layers=names[: len(names) - rank])
        out["mismatch"] = None
    except LayoutMismatchError as e:
        out["mismatch"] = str(e)
    try:  # rank 1 names a layer the model lacks: both ranks refuse, neither waits
        ShadowNumerics(model, dscale.StepGuard("cpu"), layers=["nope"] if rank else None)
        out["unknown"] = None
    except ValueError as e:
        out["unknown"] = str(e)
    return out
