"""Real fp16 training runs for ``python -m dscale.bench scaling``, one arm per scaler, interleaved.

An arm is a model, an AdamW optimizer and a scaler: torch's GradScaler, dscale's with
``policy="dynamic"`` or with ``policy="predictive"``. The arms of a group share the seed, the
initial weights and every batch, and take their steps in lockstep, starting at a rotating arm,
so that a noisy machine disturbs them alike (the time of a step is the forward, backward, step and
update; the oracle and the underflow count below are not timed).

On probe steps (every step of the first ``early`` steps, then every ``every`` steps) each arm also
records, on its own weights and batch:

* the oracle: the largest power-of-two scale whose fp16 backward has no inf/NaN, by bisection
  over the exponent (the backward is re-run with ``torch.autograd.grad``; ``.grad`` is untouched);
* the underflow share: of the gradient elements that are nonzero at the largest safe scale (the
  oracle's own backward), those whose value at the arm's scale lies below fp16's smallest normal
  number, on steps the arm applied. Elements that are zero even there (embedding rows of tokens
  not in the batch) are left out, so the share moves only with the scale.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import dscale
from dscale.bench._scaling_models import batches, build, loss_weight, lr_factor

ARMS = ("torch", "dynamic", "predictive")
FP16_MIN_NORMAL = 2.0**-14
ORACLE_EXPONENTS = (0, 48)


@dataclass
class ArmRecord:
    """What one arm did, step by step."""

    scales: list[float] = field(default_factory=list)  # the scale the step ran at
    skipped: list[bool] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # unweighted loss of the step
    seconds: list[float] = field(default_factory=list)
    oracle: dict[int, float] = field(default_factory=dict)  # step -> largest safe scale
    underflow: dict[int, float] = field(default_factory=dict)  # step -> share


def make_scaler(arm: str, init_scale: float) -> Any:
    """The scaler of ``arm``; all on the CPU, default settings otherwise."""
    if arm == "torch":
        return torch.amp.GradScaler("cpu", init_scale=init_scale)
    if arm == "dynamic":
        return dscale.GradScaler("cpu", init_scale=init_scale, policy="dynamic")
    if arm == "predictive":
        return dscale.GradScaler("cpu", init_scale=init_scale, policy="predictive")
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def largest_safe_scale(
    params: Sequence[torch.Tensor], loss: torch.Tensor, hint: float = 0.0
) -> tuple[float, list[torch.Tensor]]:
    """The largest 2**e whose backward stays finite (0.0: none), and its unscaled gradients.

    Overflow is monotone in the scale, so a search over the exponent finds it: galloping from
    ``hint`` (the previous probe's answer, usually within one power of two), then bisection.
    """
    found: dict[int, list[torch.Tensor]] = {}

    def finite_at(e: int) -> bool:
        grads = torch.autograd.grad(loss * 2.0**e, params, retain_graph=True, allow_unused=True)
        kept = [g for g in grads if g is not None]
        if all(bool(torch.isfinite(g).all()) for g in kept):
            found[e] = [g / 2.0**e for g in kept]
            return True
        return False

    low, high = ORACLE_EXPONENTS
    start = min(max(round(math.log2(hint)) if hint > 0 else low, low), high)
    step = 1
    if finite_at(start):  # gallop up: lo finite, hi not (or past the range)
        lo, hi = start, start + 1
        while hi <= high and finite_at(hi):
            lo, hi, step = hi, min(hi + 2 * step, high + 1), 2 * step
    else:  # gallop down
        lo, hi = start - 1, start
        while lo >= low and not finite_at(lo):
            hi, lo, step = lo, max(lo - 2 * step, low - 1), 2 * step
        if lo < low:
            return 0.0, []
    while hi - lo > 1:  # finite at lo, not at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if finite_at(mid) else (lo, mid)
    return 2.0**lo, found[lo]


def underflow_share(reference: list[torch.Tensor], scale: float) -> float:
    """Of the elements nonzero in ``reference`` (unscaled), the share below fp16's min normal
    once multiplied by ``scale``."""
    nonzero = sum(int((g != 0).sum()) for g in reference)
    small = sum(int(((g != 0) & (g.abs() * scale < FP16_MIN_NORMAL)).sum()) for g in reference)
    return small / max(nonzero, 1)


@dataclass
class _Arm:
    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: Any
    record: ArmRecord


def arm_key(arm: str, init_scale: float) -> str:
    """``dynamic@2^16``: the arm and its init scale."""
    return f"{arm}@2^{round(math.log2(init_scale))}"


def run_group(
    model_name: str, seed: int, inits: tuple[float, ...], cfg: dict[str, Any]
) -> dict[str, ArmRecord]:
    """Train every (arm, init scale) for ``cfg["steps"]`` steps in lockstep; return the records."""
    steps, seq_len = cfg["steps"], cfg["seq_len"]
    data = batches(seed, seq_len, cfg["batch_size"])
    arms = []
    for init_scale in inits:
        for name in ARMS:
            torch.manual_seed(seed)
            model = build(model_name, seq_len)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
            scaler = make_scaler(name, init_scale)
            arms.append(_Arm(arm_key(name, init_scale), model, opt, scaler, ArmRecord()))
    for step in range(steps):
        tokens = data(step)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        weight = loss_weight(model_name, step, steps)
        lr = cfg["lr"] * lr_factor(model_name, step, steps)
        for arm in arms:
            for group in arm.opt.param_groups:
                group["lr"] = lr
        # A step whose loss weight is 0 has no largest safe scale to probe (any scale is safe).
        probe = (step < cfg["early"] or step % cfg["every"] == 0) and weight != 0
        first = step % len(arms)
        for arm in arms[first:] + arms[:first]:
            _step(arm, inputs, targets, weight, step, probe)
    return {arm.name: arm.record for arm in arms}


def _step(
    arm: _Arm,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    weight: float,
    step: int,
    probe: bool,
) -> None:
    rec, scaler = arm.record, arm.scaler
    rec.scales.append(float(scaler.get_scale()))
    params = [p for p in arm.model.parameters() if p.requires_grad]
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = arm.model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) * weight
    elapsed = time.perf_counter() - start
    reference: list[torch.Tensor] = []
    if probe:  # untimed
        hint = rec.oracle[max(rec.oracle)] if rec.oracle else 0.0
        rec.oracle[step], reference = largest_safe_scale(params, loss, hint)
    start = time.perf_counter()
    scaler.scale(loss).backward()
    scaler.step(arm.opt)
    scaler.update()
    arm.opt.zero_grad(set_to_none=True)
    elapsed += time.perf_counter() - start
    rec.seconds.append(elapsed)
    rec.skipped.append(_skipped(scaler, rec.scales[-1]))
    if reference and not rec.skipped[-1]:  # untimed
        rec.underflow[step] = underflow_share(reference, rec.scales[-1])
    rec.losses.append(loss.item() / weight if weight else math.nan)


def _skipped(scaler: Any, scale_before: float) -> bool:
    if isinstance(scaler, dscale.GradScaler):
        return not scaler.step_applied()
    # torch's scaler: a skipped step is exactly one whose update backed off.
    return float(scaler.get_scale()) < scale_before
