"""How far one Adam step can move a weight element: the bound behind agreed weight scales.

Torch's Adam/AdamW step for one element, with the group's hyperparameters at that step
(``lr``, ``b1``, ``b2``, ``eps``, ``wd``) and the weight's own step count ``t``::

    w <- w * (1 - lr * wd)                      (AdamW, or Adam(decoupled_weight_decay=True))
    m <- b1 * m + (1 - b1) * g                  (g: the gradient; Adam's L2 decay is in it)
    v <- b2 * v + (1 - b2) * g^2
    w <- w - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

**Claim.** Let ``S`` be a number with ``m^2 <= S * v`` for every element before the step (``S = 0``
before the first step, where ``m = v = 0``). After the step, every element satisfies
``m^2 <= S' * v`` with ``S' = (b1^2 / b2) * S + (1 - b1)^2 / (1 - b2)``, and the step moved it by
at most ``lr * sqrt(S') * sqrt(1 - b2^t) / (1 - b1^t)`` on top of the decay's factor. So after it
``max|w| <= |1 - lr * wd| * max|w|_before + lr * sqrt(S') * sqrt(1 - b2^t) / (1 - b1^t)``.

**Proof.** ``|m'| <= b1 |m| + (1 - b1)|g| <= (b1 sqrt(S) / sqrt(b2)) * sqrt(b2 v) +
((1 - b1) / sqrt(1 - b2)) * sqrt((1 - b2) g^2)``, and by Cauchy-Schwarz for two terms that is at
most ``sqrt(b1^2 S / b2 + (1 - b1)^2 / (1 - b2)) * sqrt(b2 v + (1 - b2) g^2) = sqrt(S') sqrt(v')``.
The step's move is ``lr |m'| / (1 - b1^t) / (sqrt(v') / sqrt(1 - b2^t) + eps)``; ``eps >= 0``
only shrinks it, which gives the bound. The decay multiplies ``|w|`` by ``|1 - lr * wd|`` (more
than 1 where ``lr * wd > 2``). Nothing here assumes the hyperparameters stayed the same: each
step folds in the ``b1``, ``b2``, ``lr`` and ``wd`` it ran with (a beta schedule, an lr
schedule), and a weight that had no gradient was not stepped (Adam skips it: no move, no
decay, its ``S`` and ``t`` unchanged). amsgrad divides by ``max(v)`` >= ``v`` and maximize
flips the sign, so the bound holds for both; L2 decay is part of ``g``, which the bound does not
depend on. ``b2 = 0`` with ``S > 0`` gives no finite bound (``v`` then forgets what ``m``
keeps), nor do betas outside ``[0, 1)`` or ``eps < 0`` set mid-run (torch's constructor refuses
them, its step does not): :class:`MomentBound` says so (an infinite reach) and
:class:`~dscale.fp8.WeightScales` measures instead. A negative ``lr`` (a schedule run past its
end) moves by ``|lr|`` times the same bound, which is what the reach uses.

For constant betas from ``S = 0`` this is the closed form :func:`adam_update_bound`: B(1) = 1,
and B rises to about 1.165 for (0.9, 0.95) and 7.27 for (0.9, 0.999). A gradient sequence
reaches it (``g_k`` proportional to ``(b2 / b1)^k`` with a fixed sign), so it cannot be tightened
from the hyperparameters alone. Everything is float64, from hyperparameters, step counts and
agreed numbers: the same on every rank.
"""

from __future__ import annotations

import math
from operator import is_not as _is_not
from typing import Any

import torch

#: Optimizers with a known bound; others fall back to torchao's precompute.
BOUNDED = (torch.optim.Adam, torch.optim.AdamW)


def adam_update_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam can produce at step ``step`` (1-based), with
    the same betas at every step (the closed form of :class:`MomentBound`'s recurrence)."""
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
    return type(optimizer) in BOUNDED


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return getattr(t, "_local_tensor", t)


class MomentBound:
    """Per float8 weight, the ``S`` of the module docstring and the step count it was made at.

    :meth:`advance` runs after each applied step: it reads every weight's own Adam step count
    (one ``stack`` of the optimizer's step tensors, found again whenever one of them is not the
    tensor read before: a load, ``state.clear()``, a deleted or replaced entry; on a GPU with a
    fused or capturable Adam that read is a host sync), folds the group's
    hyperparameters into ``S`` for the weights whose count moved by one, and returns each
    weight's decay factor and reach. A count that moved by more than one or went back (steps
    taken outside the scaler, optimizer state loaded without this state) leaves ``S`` unknown:
    it returns None, and the caller measures ``S`` from the moments (:meth:`measure_local`, one
    collective) with :meth:`reset`.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, weights: list[Any], group_index: torch.Tensor
    ) -> None:
        self._optimizer = optimizer
        self._weights = weights
        self._group_index = group_index
        n = len(weights)
        self.ratio_sq = torch.zeros(n, dtype=torch.float64)  # S per weight
        self.steps = torch.zeros(n, dtype=torch.float64)  # its step count when S was made
        self._seen: list[Any] | None = None  # the step tensors last read (None: no state)
        self._step_tensors: list[torch.Tensor] = []

    def read_steps(self) -> torch.Tensor:
        """Every weight's own Adam step count (0 without state), float64 on the CPU."""
        state = self._optimizer.state
        # The step tensors themselves, compared by identity every call (one per float8 layer):
        # a load makes a new state dict, and ``state.clear()``, a deleted entry or a replaced
        # ``step`` keep the dict and its length but drop the tensors read before.
        found = [state[w]["step"] if "step" in state.get(w, ()) else None for w in self._weights]
        if self._seen is None or any(map(_is_not, found, self._seen)):
            self._seen = found
            like = next((t for t in found if t is not None), None)
            zero = torch.zeros((), dtype=torch.float32 if like is None else like.dtype)
            if like is not None:
                zero = zero.to(like.device)
            self._step_tensors = [zero if t is None else t for t in found]
        if not self._step_tensors:
            return torch.zeros(0, dtype=torch.float64)
        return torch.stack(self._step_tensors).detach().to("cpu", torch.float64).reshape(-1)

    def _per_weight(self) -> dict[str, torch.Tensor]:
        """The groups' hyperparameters (as they are now) at each weight, float64."""
        rows = []
        for group in self._optimizer.param_groups:
            beta1, beta2 = (float(b) for b in group["betas"])
            decoupled = isinstance(self._optimizer, torch.optim.AdamW) or bool(
                group.get("decoupled_weight_decay")
            )
            lr, eps = float(group["lr"]), float(group["eps"])
            rows.append([lr, beta1, beta2, float(group["weight_decay"]) * decoupled, eps])
        table = torch.tensor(rows, dtype=torch.float64)[self._group_index]
        return dict(zip(("lr", "beta1", "beta2", "decay", "eps"), table.unbind(1)))

    def advance(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After an applied step: (decay factor, reach) per weight, float64; None if unknown.

        ``max|w|`` after the step is at most ``factor * max|w|_before + reach``; a weight that
        was not stepped gets (1, 0).
        """
        now = self.read_steps()
        delta = now - self.steps
        stepped = delta == 1
        if bool(((delta != 0) & ~stepped).any()):
            return None
        if not bool(stepped.any()):
            return torch.ones_like(now), torch.zeros_like(now)
        h = self._per_weight()
        beta1, beta2, lr = h["beta1"], h["beta2"], h["lr"]
        # b1^2 / b2; b2 = 0 keeps nothing of v, so any carried S > 0 has no bound (inf).
        r = torch.where(beta2 > 0, beta1 * beta1 / beta2, torch.where(beta1 > 0, math.inf, 0.0))
        carried = torch.where(self.ratio_sq > 0, r * self.ratio_sq, 0.0)
        ratio_sq = torch.where(stepped, carried + (1 - beta1) ** 2 / (1 - beta2), self.ratio_sq)
        t = torch.where(stepped, now, 1.0)  # (t = 0 is never a stepped weight's)
        bound = ratio_sq.sqrt() * (1 - beta2**t).sqrt() / (1 - beta1**t)
        # |lr|: a schedule run past its end (LambdaLR's 1 - t / T) gives lr < 0, which torch's
        # Adam applies. Betas outside [0, 1) or eps < 0 (set mid-run; the constructor refuses
        # them) have no bound: inf, so the caller measures.
        sound = (beta1 >= 0) & (beta1 < 1) & (beta2 >= 0) & (beta2 < 1) & (h["eps"] >= 0)
        reach = torch.where(stepped, lr.abs() * bound, 0.0)
        reach = torch.where(stepped & ~sound, math.inf, reach)
        factor = torch.where(stepped, (1 - lr * h["decay"]).abs(), 1.0)
        self.ratio_sq, self.steps = ratio_sq, now
        return factor, reach

    def measure_local(self) -> list[float]:
        """This rank's ``max(m^2 / v)`` over each weight's shard, float64 (0 without moments).

        The sharpest ``S`` the moments allow (0/0 is 0; m != 0 over v = 0 is inf). A loop
        over the weights: it runs at construction and where :meth:`advance` returned None.
        """
        out = []
        for w in self._weights:
            state = self._optimizer.state.get(w, {})
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                out.append(0.0)
                continue
            m = _local(state["exp_avg"]).detach().double()
            v = _local(state["exp_avg_sq"]).detach().double()
            if m.numel() == 0:
                out.append(0.0)
                continue
            zero = torch.zeros((), dtype=torch.float64, device=m.device)
            ratio = torch.where(
                v > 0, m * m / v, torch.where(m == 0, zero, torch.full_like(zero, math.inf))
            )
            out.append(float(ratio.max()))
        return out

    def reset(self, ratio_sq: torch.Tensor, steps: torch.Tensor) -> None:
        """Take ``S`` and the step counts it holds at (agreed, or from a checkpoint)."""
        self.ratio_sq = ratio_sq.detach().to("cpu", torch.float64).clone()
        self.steps = steps.detach().to("cpu", torch.float64).clone()
