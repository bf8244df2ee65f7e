"""``python -m dscale.bench fp8 --mxfp8``: MXFP8 training, dscale's one call against torchao alone.

Two arms on 2 gloo ranks, FSDP2 with a bf16 all-gather (``MixedPrecisionPolicy(param_dtype=
bfloat16)``), AdamW: ``mxfp8_torchao`` puts torchao's ``MXFP8Linear`` in by hand (every exact
``nn.Linear`` but the head) and steps with ``optimizer.step()``; ``mxfp8_dscale`` converts with
``dscale.fp8.convert_to_float8(recipe=...)`` and steps through a ``StepGuard`` (agreed skips).
Both emulate MXFP8 (torchao's ``KernelPreference.EMULATED``: no MX kernels on a CPU). Counted,
not timed: all-reduces per step, MXFP8 layers, losses (equal bit for bit is the claim).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dscale import StepGuard
from dscale.bench import _fp8

ARMS = ("mxfp8_torchao", "mxfp8_dscale")


def _by_hand(model: nn.Module, recipe: str) -> int:
    """torchao's MXFP8Linear in place of each exact nn.Linear but the head; how many."""
    from dscale.fp8 import _torchao

    cls = _torchao.mxfp8_linear_class()
    preference, mode = _torchao.mx_options(emulate=True)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "head"]
    for name in names:
        old = model.get_submodule(name)
        new = cls(
            old.in_features,
            old.out_features,
            kernel_preference=preference,
            scale_calculation_mode=mode,
            wgrad_with_hp=recipe == "mxfp8_wgrad_with_hp",
        )
        new.load_state_dict(old.state_dict())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return len(names)


def run_mx_arm(
    rank: int,
    model_name: str,
    arm: str,
    *,
    steps: int,
    lr: float,
    betas: tuple[float, float],
    recipe: str = "mxfp8",
) -> dict[str, Any]:
    """Train one MXFP8 arm on this rank for ``steps``; return what the benchmark reports."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dscale.fp8 as fp8

    torch.manual_seed(0)
    model = _fp8.MODELS[model_name]()
    if arm == "mxfp8_dscale":
        conv = fp8.convert_to_float8(
            model,
            recipe=recipe,  # type: ignore[arg-type]
            keep_high_precision=["head"],
            emulate=True,
        )
        layers = len(conv.converted)
    else:
        layers = _by_hand(model, recipe)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks():  # type: ignore[operator]
        fully_shard(block, mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
    guard = StepGuard("cpu") if arm == "mxfp8_dscale" else None
    losses: list[float] = []

    def one_step(step: int) -> None:
        tokens, target = _fp8.batch(step, rank)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        if guard is None:
            loss.backward()
            opt.step()
        else:
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
        opt.zero_grad()
        losses.append(loss.item())

    counted = 0
    for step in range(steps):
        if step == min(steps - 1, 5):
            counted = _fp8.allreduces_in(lambda s=step: one_step(s))
        else:
            one_step(step)
    return {
        "recipe": recipe,
        "collectives_per_step": counted,
        "mxfp8_layers": layers,
        "final_loss": losses[-1],
        "losses": losses,
        "skipped_steps": 0 if guard is None else int(guard.snapshot()["skipped_steps"]),
    }
