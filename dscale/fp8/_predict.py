"""The float8 weights' amaxes after the coming Adam/AdamW step, computed before the step.

``WeightScales(predict="exact")``: the scale after a step then comes from the weights the step
will produce, not from a bound on it. Each rank computes its shards' post-step weights from
the gradient and the moments exactly as torch's Adam/AdamW will (decay, ``lerp`` of the first
moment, ``addcmul`` of the second, the bias corrections, ``addcdiv``), before the agreement
collective, so the amaxes ride it with the pre-step ones. Measured on the CPU: bitwise the
real post-step amax with the foreach, single-tensor and fused AdamW, 200 steps; ``WeightScales``
keeps its 2^-16 margin for rounding. Options that change the math (amsgrad, maximize,
capturable, differentiable) or several parameter groups over the float8 weights leave the bound
in use; so does, per weight, a missing gradient (not stepped: the bound is then exact) or
missing moments (its first step).

The gradients are read when the agreement starts: at step(), or, after ``unscale_()``, at the
flag's first read in step() (``WeightScales.refresh``), so that clipping in between (torch's
AMP recipe) is what the prediction sees.
"""

from __future__ import annotations

import math
from typing import Any

import torch

UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return getattr(t, "_local_tensor", t)


def unsupported(optimizer: torch.optim.Optimizer, group_index: torch.Tensor) -> str | None:
    """Why the post-step amaxes cannot be computed for ``optimizer`` (None: they can)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not Adam or AdamW"
    if group_index.numel() and bool((group_index != group_index[0]).any()):
        return "the float8 weights are in several parameter groups"
    for group in optimizer.param_groups:
        on = [k for k in UNSUPPORTED if group.get(k)]
        if on:
            return f"{', '.join(on)} is on"
    return None


class PostStepAmax:
    """Per float8 weight, this rank's shard amax after the coming step (+inf where not known).

    Each weight with a gradient and moments is computed with its own step count, as torch's
    Adam does; a weight without a gradient is not stepped, and one without moments yet (its
    first step) is left to the bound: +inf there, which rides the MAX and makes every rank use
    the bound for that weight.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        weights: list[Any],
        shards: list[torch.Tensor],
        group: int,
    ) -> None:
        self._optimizer = optimizer
        self._weights = weights
        self.shards = shards  # replaced by WeightScales.load_state_dict
        self._group = group

    def __call__(self) -> torch.Tensor | None:
        """The post-step amaxes, or None where no weight can be computed (step 1)."""
        state = self._optimizer.state
        ready = []  # (index, gradient, exp_avg, exp_avg_sq, step count after the step)
        for i, w in enumerate(self._weights):  # as the optimizer collects them
            s = state.get(w)
            if w.grad is not None and s and "exp_avg" in s:
                ready.append((i, w.grad, s["exp_avg"], s["exp_avg_sq"], float(s["step"]) + 1))
        if not ready:
            return None
        index, grads, exp_avgs, exp_avg_sqs, steps = zip(*ready)
        post = self._post_amax(
            [_local(g) for g in grads],
            [_local(m) for m in exp_avgs],
            [_local(v) for v in exp_avg_sqs],
            [self.shards[i] for i in index],
            list(steps),
        )
        out = torch.full((len(self._weights),), math.inf, dtype=post.dtype, device=post.device)
        out[list(index)] = post
        return out

    def _post_amax(
        self,
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        shards: list[torch.Tensor],
        steps: list[float],
    ) -> torch.Tensor:
        group = self._optimizer.param_groups[self._group]
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        eps, wd = float(group["eps"]), float(group["weight_decay"])
        decoupled = isinstance(self._optimizer, torch.optim.AdamW) or bool(
            group.get("decoupled_weight_decay")
        )
        if wd and not decoupled:  # Adam's L2 decay goes into the gradient
            grads = list(torch._foreach_add(grads, shards, alpha=wd))
        m = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
        v = torch._foreach_mul(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        # Per weight, with its own step count (as torch's Adam: scalars from Python floats).
        step_size = [-(lr / (1 - beta1**t)) for t in steps]
        bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in steps]
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        post = torch._foreach_mul(shards, 1 - lr * wd if decoupled else 1.0)
        torch._foreach_addcdiv_(post, m, denom, step_size)
        return torch.stack(torch._foreach_norm(post, float("inf")))
