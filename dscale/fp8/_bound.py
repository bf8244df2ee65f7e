"""How far one optimizer step can move a weight element: the bound behind agreed weight scales.

Adam's update is ``lr * m_hat / (sqrt(v_hat) + eps)``. By Cauchy-Schwarz over the moment sums,
``|m_hat| / sqrt(v_hat) <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_k r^k) * sqrt(1 - b2^t) / (1 - b1^t)``
with ``r = b1^2 / b2`` and k = 0 .. t-1, whatever the gradients were: B(1) = 1, and for
(0.9, 0.95) B rises to about 1.165, for (0.9, 0.999) to about 7.27. AdamW's decoupled decay
multiplies by ``1 - lr * wd`` first, which only shrinks ``|w|``; Adam's L2 decay goes into the
gradient, which the bound does not depend on. So after step t, ``max|w| <= amax + lr * B(t)``.
Computed in float64 from hyperparameters and the step count: the same number on every rank.
"""

from __future__ import annotations

import math

import torch

#: Optimizers with a known bound; others fall back to torchao's precompute.
BOUNDED = (torch.optim.Adam, torch.optim.AdamW)


def adam_update_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam can produce at step ``step`` (1-based)."""
    if step < 1:
        return 0.0
    r = beta1 * beta1 / beta2
    terms = float(step) if r == 1.0 else (1.0 - r**step) / (1.0 - r)
    return (
        (1.0 - beta1)
        / math.sqrt(1.0 - beta2)
        * math.sqrt(terms)
        * math.sqrt(1.0 - beta2**step)
        / (1.0 - beta1**step)
    )


def has_bound(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s per-element update has a gradient-independent bound here."""
    # amsgrad divides by a larger v_hat, maximize flips the sign: the bound holds for both.
    return type(optimizer) in BOUNDED


def group_step_bounds(optimizer: torch.optim.Optimizer) -> list[float]:
    """Per param group: ``lr * B(t)`` for the step just taken (``t`` from the optimizer's state).

    Reads each group's step count from its first parameter with state (a host read of a CPU
    tensor unless the optimizer is capturable or fused on a GPU, where it waits for the GPU).
    """
    bounds = []
    for group in optimizer.param_groups:
        step = 0
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                step = int(state["step"])
                break
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        bounds.append(lr * adam_update_bound(float(beta1), float(beta2), step))
    return bounds
