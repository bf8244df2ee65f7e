"""The float8 weights' amaxes after the coming Adam/AdamW step, computed before the step.

``WeightScales(predict="exact")``: the scale after a step then comes from the weights the step
will produce, not from a bound on it. Each rank computes its shards' post-step weights from
the gradient and the moments exactly as torch's Adam/AdamW will (decay, ``lerp`` of the first
moment, ``addcmul`` of the second, the bias corrections, ``addcdiv``), before the agreement
collective, so the amaxes ride it with the pre-step ones. Measured on the CPU: bitwise the
real post-step amax with the foreach, single-tensor and fused AdamW, 200 steps; ``WeightScales``
keeps its 2^-16 margin for rounding. Options that change the math (amsgrad, maximize,
capturable, differentiable), several parameter groups over the float8 weights, or a missing
gradient or moment leave the bound in use.
"""

from __future__ import annotations

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
    """Per float8 weight, this rank's shard amax after the coming step (None before step 2)."""

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
        self._moments: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._first: Any = None

    def __call__(self) -> torch.Tensor | None:
        state = self._optimizer.state.get(self._weights[0]) if self._weights else None
        if not state or "exp_avg" not in state:
            return None  # no moments yet (step 1): the bound holds there
        if self._moments is None or state["exp_avg"] is not self._first:
            moments = [self._optimizer.state.get(w, {}) for w in self._weights]
            if not all("exp_avg" in s for s in moments):
                return None
            self._first = state["exp_avg"]
            self._moments = (
                [_local(s["exp_avg"]) for s in moments],
                [_local(s["exp_avg_sq"]) for s in moments],
            )
        grads = [w.grad for w in self._weights]  # as the optimizer collects them
        if any(g is None for g in grads):
            return None
        return self._post_amax([_local(g) for g in grads], int(state["step"]) + 1)

    def _post_amax(self, grads: list[torch.Tensor], step: int) -> torch.Tensor:
        group = self._optimizer.param_groups[self._group]
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        eps, wd = float(group["eps"]), float(group["weight_decay"])
        decoupled = isinstance(self._optimizer, torch.optim.AdamW) or bool(
            group.get("decoupled_weight_decay")
        )
        exp_avgs, exp_avg_sqs = self._moments  # type: ignore[misc]
        if wd and not decoupled:  # Adam's L2 decay goes into the gradient
            grads = list(torch._foreach_add(grads, self.shards, alpha=wd))
        m = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
        v = torch._foreach_mul(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        post = torch._foreach_mul(self.shards, 1 - lr * wd if decoupled else 1.0)
        torch._foreach_addcdiv_(post, m, denom, -(lr / bias_correction1))
        return torch.stack(torch._foreach_norm(post, float("inf")))
