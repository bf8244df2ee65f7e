"""Runs of Float8Numerics on rowwise and MXFP8 models, one process or inside a rank (DDP)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from dscale.fp8._granular import mx_stats, rowwise_stats
from tests.fp8 import _models

LAYER = "blocks.1.fc2"  # where an outlier goes (64 inputs: two MXFP8 blocks per row)
OUTLIER_AT = (1, 40)  # (token row of the flattened input, feature): row 1, its 2nd block
E4M3 = torch.float8_e4m3fn


def run(
    rank: int,
    recipe: str,
    *,
    every: int | None = 2,
    steps: int = 3,
    outlier_step: int | None = None,
    ddp: bool = False,
    count: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` (batches of 2 x 16 tokens); return snapshots after sampled steps, the
    tensors ``LAYER`` saw at the last sampled step (input, weight, grad_output), and per step
    the aten ops dispatched and host reads (``tolist``/``item``) made, when ``count``."""
    model = _models.net()
    fp8.convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
    layer = model.get_submodule(LAYER)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=every) if every else None
    seen: dict[str, torch.Tensor] = {}
    step_now = [0]

    def blow_up(module: nn.Module, args: tuple[Any, ...]) -> Any:
        if step_now[0] == outlier_step and rank == 1:
            x = args[0].clone()
            x.view(-1, x.shape[-1])[OUTLIER_AT] *= 1e6
            return (x,)
        return None

    def capture(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        seen["input"] = args[0].detach().clone()
        seen["weight"] = module.weight.detach().clone()
        output.register_hook(lambda g: seen.__setitem__("grad_output", g.detach().clone()))

    layer.register_forward_pre_hook(blow_up)
    if not count:
        layer.register_forward_hook(capture)
    out: dict[str, Any] = {"snapshots": {}, "ops": [], "reads": [], "seen": {}}
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
            reads = [0]
            originals = {n: getattr(torch.Tensor, n) for n in ("tolist", "item")}

            def counting(name: str, reads: list[int] = reads, originals: Any = originals) -> Any:
                def call(self: torch.Tensor, *a: Any) -> Any:
                    reads[0] += 1
                    return originals[name](self, *a)

                return call

            for name in originals:
                setattr(torch.Tensor, name, counting(name))
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                    one()
            finally:
                for name, fn in originals.items():
                    setattr(torch.Tensor, name, fn)
            out["ops"].append(sum(1 for e in p.events() if e.name.startswith("aten::")))
            out["reads"].append(reads[0])
        else:
            one()
        if numerics is not None and numerics.sampled_last_step:
            out["snapshots"][step] = numerics.snapshot()
            out["seen"] = {k: v.clone() for k, v in seen.items()}
    if numerics is not None:
        out["fields"] = numerics.fields
        out["granularity"] = numerics.granularity
    return out


def per_part(x: torch.Tensor, recipe: str) -> list[float]:
    """Flushed elements per MXFP8 block (or per row, rowwise) of ``x``'s last-dim layout."""
    rows = x.detach().float().reshape(-1, x.shape[-1])
    if recipe == "mxfp8":
        parts = rows.reshape(-1, 32)
        return [float(mx_stats(b.reshape(1, 32))[2]) * 32 for b in parts]
    return [float(rowwise_stats(r.reshape(1, -1), E4M3)[2]) * r.numel() for r in rows]


def ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Both recipes under DDP: a clean run and one with an outlier on rank 1 at step 2."""
    out = {}
    for recipe in ("rowwise", "mxfp8"):
        clean = run(rank, recipe, ddp=True)
        hit = run(rank, recipe, ddp=True, outlier_step=2)
        out[recipe] = {
            "clean": clean["snapshots"],
            "hit": hit["snapshots"],
            "seen": hit["seen"],
            "parts_clean": per_part(clean["seen"]["input"], recipe),
            "parts_hit": per_part(hit["seen"]["input"], recipe),
        }
    return out
