"""Rank functions for the FP8 resume tests: save through dscale.checkpoint, resume, compare.

The oracle is the uninterrupted run, made in the same spawn: a resume must reproduce its losses,
weight scales and FP8 samples bit for bit, with and without ``extra=`` naming the FP8 state.
"""

from __future__ import annotations

from typing import Any

import torch

import dscale
import dscale.fp8 as fp8
from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from tests.fp8 import _fsdp_ranks, _models


def _build(seed: int, *, keep: list[str] | None = None, scales: bool = True, every: int = 0):
    torch.manual_seed(seed)
    model, conv = _fsdp_ranks.sharded(keep)
    if seed:  # other weights than the saved run's: the load must bring them
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    guard = dscale.StepGuard("cpu")
    ws = fp8.WeightScales(model, opt, guard, conv) if scales else None
    numerics = fp8.Float8Numerics(model, guard, every=every) if every else None
    return model, opt, guard, ws, numerics


def _steps(rank, model, opt, guard, scales, steps, numerics=None) -> list[Any]:
    out = []
    samples = None if numerics is None else numerics.num_samples
    for step in steps:
        tokens, target = _models.batch(step, rank)
        loss = _models.loss_of(model, tokens, target)
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        row = [loss.item(), None if scales is None else scales.scales.tolist()]
        if numerics is not None:  # the sample, on the steps that took one
            sampled = numerics.num_samples != samples
            samples = numerics.num_samples
            row += [samples, numerics.snapshot() if sampled else None]
        out.append(tuple(row))
    return out


def _params(model) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _refusal(fn) -> str:
    try:
        fn()
    except (CheckpointError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def resume(rank: int, world: int, directory: str) -> dict[str, Any]:
    """FSDP2 float8 all-gather, WeightScales and Float8Numerics (every 2); saved at step 3."""
    model, opt, guard, scales, numerics = _build(0, every=2)
    whole = _steps(rank, model, opt, guard, scales, range(6), numerics)

    model, opt, guard, scales, numerics = _build(0, every=2)
    first = _steps(rank, model, opt, guard, scales, range(3), numerics)
    CheckpointManager(f"{directory}/auto", every=0).save(  # the FP8 state not named
        3, model=model, optimizer=opt, scaler=guard
    )
    named = {"fp8_weight_scales": scales, "fp8_numerics": numerics}
    CheckpointManager(f"{directory}/named", every=0).save(  # as docs/fp8.md said before
        3, model=model, optimizer=opt, scaler=guard, extra=named
    )

    out: dict[str, Any] = {"whole": whole, "first": first}
    for name, where, extra in (
        ("resumed", "auto", False),
        ("named_saved", "named", False),
        ("named_both", "named", True),
        ("named_load", "auto", True),
    ):
        model, opt, guard, scales, numerics = _build(1, every=2)
        loads = []
        original = scales.load_state_dict
        scales.load_state_dict = lambda state, f=original, n=loads: (n.append(1), f(state))[1]
        given = {"fp8_weight_scales": scales, "fp8_numerics": numerics} if extra else None
        try:
            step = load_checkpoint(
                f"{directory}/{where}/step-3", model=model, optimizer=opt, scaler=guard, extra=given
            )
        except CheckpointError as exc:  # on every rank alike; the test shows it
            out[name], out[name + "_loads"] = f"CheckpointError: {exc}", len(loads)
            continue
        out[name] = _steps(rank, model, opt, guard, scales, range(step, 6), numerics)
        out[name + "_loads"] = len(loads)

    # A checkpoint saved without any FP8 state (no WeightScales then): refused, nothing changed.
    model, opt, guard, _, _ = _build(0, scales=False)
    _steps(rank, model, opt, guard, None, range(1))
    CheckpointManager(f"{directory}/bare", every=0).save(
        1, model=model, optimizer=opt, scaler=guard
    )
    model, opt, guard, scales, _ = _build(1)
    before, scales_before = _params(model), scales.scales.clone()
    out["bare"] = _refusal(
        lambda: load_checkpoint(
            f"{directory}/bare/step-1", model=model, optimizer=opt, scaler=guard
        )
    )
    out["bare_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, _params(model))
    ) and torch.equal(scales_before, scales.scales)
    return out


def mismatched(rank: int, world: int, directory: str) -> dict[str, Any]:
    """WeightScales state of one conversion offered to another with as many float8 layers."""
    model, opt, guard, scales, _ = _build(0, keep=["blocks.0.fc1"])
    _steps(rank, model, opt, guard, scales, range(2))
    CheckpointManager(directory, every=0).save(2, model=model, optimizer=opt, scaler=guard)
    saved = scales.state_dict()

    model, opt, guard, other, _ = _build(1, keep=["blocks.1.fc2"])
    before, scales_before = _params(model), other.scales.clone()
    out = {
        "layers": (scales.names, other.names),
        "checkpoint": _refusal(
            lambda: load_checkpoint(f"{directory}/step-2", model=model, optimizer=opt, scaler=guard)
        ),
        "direct": _refusal(lambda: other.load_state_dict(saved)),
        "old_format": _refusal(
            lambda: other.load_state_dict({"scales": saved["scales"], "num_layers": 3})
        ),
    }
    out["unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, _params(model))
    ) and torch.equal(scales_before, other.scales)

    # The same layer names with other weight shapes (hidden 128 instead of 64).
    torch.manual_seed(0)
    wide = _models.Net()
    wide.blocks = torch.nn.ModuleList([_models.Block(32, 128), _models.Block(32, 128)])
    conv = fp8.convert_to_float8(
        wide, float8_all_gather=True, keep_high_precision=["blocks.0.fc1"], emulate=True
    )
    from torch.distributed.fsdp import fully_shard

    for block in wide.blocks:
        fully_shard(block)
    fully_shard(wide)
    wide_opt = torch.optim.AdamW(wide.parameters())
    wide_scales = fp8.WeightScales(wide, wide_opt, dscale.StepGuard("cpu"), conv)
    out["shapes"] = _refusal(lambda: wide_scales.load_state_dict(saved))

    # A model converted without float8 all-gather: refused on every rank.
    torch.manual_seed(0)
    plain = _models.net()
    conv = fp8.convert_to_float8(plain, emulate=True)
    for block in plain.blocks:
        fully_shard(block)
    fully_shard(plain)
    out["no_all_gather"] = _refusal(
        lambda: fp8.WeightScales(plain, torch.optim.AdamW(plain.parameters()), guard, conv)
    )
    return out


def fallback_resume(rank: int, world: int, directory: str) -> dict[str, Any]:
    """DDP, Float8Numerics every step and Float8Fallback (3 samples); an outlier enters
    blocks.0.fc1 on rank 1; saved at step 2 without naming either; resumed."""
    from torch.nn.parallel import DistributedDataParallel

    def build():
        model = _models.net()
        fp8.convert_to_float8(model, emulate=True)
        if rank == 1:

            def blow_up(module, args):
                bump = torch.zeros_like(args[0])
                bump.view(-1)[0] = args[0].detach().abs().max() * 1e4
                return (args[0] + bump,)

            model.blocks[0].fc1.register_forward_pre_hook(blow_up)
        wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        guard = dscale.StepGuard("cpu")
        numerics = fp8.Float8Numerics(wrapped, guard, every=1)
        fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=3)
        return wrapped, opt, guard, fallback

    def run(wrapped, opt, guard, fallback, steps):
        rows = []
        for step in steps:
            tokens, target = _models.batch(step, rank)
            loss = _models.loss_of(wrapped, tokens, target)
            guard.scale(loss).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()
            rows.append((loss.item(), list(fallback.fallen)))
        return rows

    whole = run(*build(), range(6))
    wrapped, opt, guard, fallback = build()
    run(wrapped, opt, guard, fallback, range(2))
    CheckpointManager(directory, every=0).save(2, model=wrapped, optimizer=opt, scaler=guard)
    wrapped, opt, guard, fallback = build()
    step = load_checkpoint(f"{directory}/step-2", model=wrapped, optimizer=opt, scaler=guard)
    return {"whole": whole, "resumed": run(wrapped, opt, guard, fallback, range(step, 6))}


def resume_on_one_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Load the 2-rank checkpoint on 1 rank; the forward of step 3 on rank 0's batch."""
    model, opt, guard, scales, _ = _build(1, every=2)
    load_checkpoint(f"{directory}/resume/auto/step-3", model=model, optimizer=opt, scaler=guard)
    tokens, target = _models.batch(3, 0)
    with torch.no_grad():
        loss = _models.loss_of(model, tokens, target).item()
    return {"scales": scales.scales.tolist(), "loss": loss}


def scenarios(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every 2-rank scenario in one spawn."""
    return {
        "resume": resume(rank, world, f"{directory}/resume"),
        "mismatched": mismatched(rank, world, f"{directory}/mismatched"),
        "fallback": fallback_resume(rank, world, f"{directory}/fallback"),
    }
