"""``python -m dscale.bench fp8``: FP8 weight scales on 2 gloo ranks, FSDP2 with float8 all-gather.

Arms, on the launcher's GPT and MLP: ``hp`` (no FP8; fp32 compute on the CPU, where bf16 GEMMs
are 10-63x slower than fp32), ``torchao`` (float8 all-gather, torchao's precompute after each
step) and ``dscale`` (``dscale.fp8.WeightScales``: the amaxes ride the one collective);
``fallback`` is ``dscale`` with ``Float8Numerics(every=10)`` and ``Float8Fallback`` (its default
threshold and samples), reporting which layers it switched or left, and when. Counted,
not timed: all-reduces per step besides FSDP's gathers and reduce-scatters, weight elements
whose cast saturates (``|w| * scale > fp8_max``), the used scale over the exact one, the loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dscale import StepGuard, _dist
from dscale.bench._scaling_models import GPT, MLP

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
FALLBACK_EVERY = 10  # the fallback arm's numerics interval: 3 samples (its default) by step 21
VOCAB, SEQ, BATCH = 256, 16, 16
MODELS = {
    "gpt": lambda: GPT(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, seq_len=SEQ),
    "mlp": lambda: MLP(vocab_size=VOCAB, d_model=64, hidden=256, n_layers=2),
}


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets of the task ``(3t + 7) mod vocab``, per rank and step."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, (3 * tokens + 7) % VOCAB


def allreduces_in(fn: Any) -> int:
    """All-reduces ``fn()`` dispatches (FSDP's all-gathers and reduce-scatters are other ops)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "c10d::allreduce_")


def _float8_weights(model: nn.Module) -> list[Any]:
    from torchao.float8.float8_linear import Float8Linear

    found = [(n, m) for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    return [m.weight for _, m in sorted(found, key=lambda item: item[0])]


def _build_arm(
    model_name: str,
    arm: str,
    lr: float,
    betas: tuple[float, float],
    fallback_threshold: float,
    fallback_samples: int,
) -> tuple[nn.Module, torch.optim.Optimizer, StepGuard, Any, Any]:
    """One arm's FSDP2 model, optimizer and StepGuard, with its FP8 pieces (numerics and
    fallback: the "fallback" arm's, else None)."""
    from torch.distributed.fsdp import fully_shard

    import dscale.fp8 as fp8

    torch.manual_seed(0)
    model = MODELS[model_name]()
    conv = None
    if arm != "hp":
        # torchao's emulation: the CPU's torch._scaled_mm took ~1 s per 256-wide GEMM here.
        conv = fp8.convert_to_float8(
            model, float8_all_gather=True, keep_high_precision=["head"], emulate=True
        )
    for block in model.blocks():  # type: ignore[operator]
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
    guard = StepGuard("cpu")
    numerics: Any = None
    fallback: Any = None
    if arm in ("dscale", "dscale_exact", "fallback"):  # dscale_exact: predict="exact"
        assert conv is not None  # noqa: S101
        predict = "exact" if arm == "dscale_exact" else "bound"
        fp8.WeightScales(model, opt, guard, conv, predict=predict)
        if arm == "fallback":
            numerics = fp8.Float8Numerics(model, guard, every=FALLBACK_EVERY)
            fallback = fp8.Float8Fallback(
                numerics, guard, threshold=fallback_threshold, samples=fallback_samples
            )
    elif arm == "torchao":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
    return model, opt, guard, numerics, fallback


def _note_fallback(
    fallback: Any,
    numerics: Any,
    seen: int,
    step: int,
    worst: dict[str, Any],
    switched: dict[str, int],
    passed: dict[str, int],
) -> int:
    """After ``step``: the largest share a new sample showed, the layers switched and those
    past the threshold; returns the samples seen."""
    if numerics.num_samples != seen:
        seen = numerics.num_samples
        for key, row in numerics.snapshot().items():
            for share in ("flushed", "subnormal", "saturated"):
                if row[share] > worst.get("share", -1.0):
                    worst.update(share=row[share], of=f"{key}/{share}", after_step=step + 1)
    for name in fallback.fallen:
        switched.setdefault(name, step + 1)
    for name, run in fallback.runs.items():
        if run >= fallback.samples:
            passed.setdefault(name, step + 1)
    return int(seen)


def _fallback_report(
    fallback: Any,
    numerics: Any,
    names: list[str],
    switched: dict[str, int],
    passed: dict[str, int],
    worst: dict[str, Any],
    decided_all: list[list[float]],
) -> dict[str, Any]:
    """The "fallback" arm's part of the result."""
    return {
        "threshold": fallback.threshold,
        "samples": fallback.samples,
        "numerics_every": FALLBACK_EVERY,
        "samples_taken": numerics.num_samples,
        "switched": [{"layer": k, "after_step": switched[k]} for k in names if k in switched],
        # passed the threshold but stayed in FP8: its weight is all-gathered in float8
        "passed_but_left": [
            {"layer": k, "after_step": passed[k]}
            for k in names
            if k in passed and k not in switched
        ],
        "layers": names,
        "largest_share_sampled": worst,
        "agreed_on_ranks": all(d == decided_all[0] for d in decided_all),
    }


def _sample_weights(
    weights: list[Any],
    locals_: list[Any],
    used_hist: list[list[float]],
    amax_hist: list[list[float]],
) -> int:
    """Before a step: the weight scales in use and the weights' amaxes (appended to the
    histories); returns how many weight elements those scales saturate."""
    if not weights:
        return 0
    used = [float(w._local_tensor._precomputed_scale) for w in weights]
    used_hist.append(used)
    amax_hist.append([float(t.abs().max()) for t in locals_])
    return sum(int((t.abs() * s > FP8_MAX).sum()) for t, s in zip(locals_, used))


def _precompute_torchao_scales(model: nn.Module) -> None:
    """torchao's own weight scales for FSDP2's float8 all-gather, after each step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def run_arm(
    rank: int,
    model_name: str,
    arm: str,
    *,
    steps: int,
    lr: float,
    betas: tuple[float, float],
    inf_steps: tuple[int, ...] = (),
    fallback_threshold: float = 0.01,
    fallback_samples: int = 3,
) -> dict[str, Any]:
    """Train one arm on this rank for ``steps``; return what the benchmark reports of it."""
    model, opt, guard, numerics, fallback = _build_arm(
        model_name, arm, lr, betas, fallback_threshold, fallback_samples
    )
    weights = _float8_weights(model) if arm != "hp" else []
    locals_ = [w._local_tensor._tensor for w in weights]
    saturated, losses, skipped = 0, [], 0
    used_hist: list[list[float]] = []
    amax_hist: list[list[float]] = []
    counted: list[int] = []
    # per float8 layer (sorted): after which step (counted from 1) it was switched to high
    # precision, and after which step it first passed the threshold on `samples` samples
    switched: dict[str, int] = {}
    passed: dict[str, int] = {}
    worst: dict[str, Any] = {}  # the largest agreed share any sample showed, with where
    seen = 0

    def one_step(step: int) -> None:
        nonlocal skipped, seen
        tokens, target = batch(step, rank)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        guard.scale(loss).backward()
        if step in inf_steps and rank == 1:  # an overflow on one rank: an agreed skip
            grad: Any = next(iter(model.parameters())).grad
            grad._local_tensor.view(-1)[0] = math.inf
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        if arm == "torchao":
            _precompute_torchao_scales(model)
        skipped += not guard.step_applied(opt)
        losses.append(loss.item())
        if fallback is not None:
            seen = _note_fallback(fallback, numerics, seen, step, worst, switched, passed)

    for step in range(steps):
        saturated += _sample_weights(weights, locals_, used_hist, amax_hist)
        if step == min(steps - 1, 5):
            counted.append(allreduces_in(lambda s=step: one_step(s)))
        else:
            one_step(step)
    # Outside the counted steps: every rank's history, for exact scales and agreement.
    flat = [x for row in amax_hist for x in row] + [x for row in used_hist for x in row]
    names = sorted(fallback.runs) if fallback is not None else []
    decided = [float(d.get(k, -1)) for k in names for d in (switched, passed)]
    every = _dist.all_gather_floats([*flat, *decided, float(saturated), losses[-1]])
    n = len(flat) // 2
    decided_all = [r[2 * n : 2 * n + len(decided)] for r in every]
    exact_amax = [max(r[i] for r in every) for i in range(n)]
    used_all = every[0][n : 2 * n]
    ratios = [u * a / FP8_MAX for u, a in zip(used_all, exact_amax)]
    result: dict[str, Any] = {
        "collectives_per_step": counted[0],
        "saturated_weight_elements": int(sum(r[-2] for r in every)),
        "min_scale_ratio": min(ratios) if ratios else None,
        "mean_scale_ratio": sum(ratios) / len(ratios) if ratios else None,
        "scales_equal_across_ranks": all(r[n : 2 * n] == used_all for r in every),
        "final_loss": sum(r[-1] for r in every) / len(every),
        "losses": losses,  # this rank's, per step (rank 0's land in the JSON)
        "skipped_steps": skipped,
        "float8_layers": len(weights),
    }
    if fallback is not None:
        result["fallback"] = _fallback_report(
            fallback, numerics, names, switched, passed, worst, decided_all
        )
    return result


def telemetry_ops(steps: int = 3) -> dict[str, int]:
    """aten ops per step a Float8Numerics(every=2) adds, unsampled (step 1) and sampled (step 2).

    One process, the MLP arm's model, no FSDP: the hooks are what is counted.
    """
    import dscale.fp8 as fp8

    counts = {}
    for every in (None, 2):
        torch.manual_seed(0)
        model = MODELS["mlp"]()
        fp8.convert_to_float8(model, keep_high_precision=["head"], emulate=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        guard = StepGuard("cpu")
        if every is not None:
            fp8.Float8Numerics(model, guard, every=every)
        ops = []
        for step in range(steps):
            tokens, target = batch(step, 0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
                guard.scale(loss).backward()
                guard.step(opt)
                guard.update()
                opt.zero_grad()
            ops.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
        counts["plain" if every is None else "numerics"] = ops
    plain, ours = counts["plain"], counts["numerics"]
    return {"extra_ops_unsampled": ours[1] - plain[1], "extra_ops_sampled": ours[2] - plain[2]}
