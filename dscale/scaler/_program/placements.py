"""Where each grad's pieces live on the mesh: Partial grads summed, and the gate's norm weights.

Under tensor parallelism (and FSDP2 x TP, HSDP) the grads are DTensors whose local tensors are
pieces of the global grad in three ways: ``Shard`` pieces partition it, a ``Replicate`` piece is the
whole of it on every rank of that mesh dim, and ``Partial`` pieces must be summed to give it.
Torch 2.13's sequence parallel leaves ``Partial(sum)`` grads on replicated params (the norms)
until the optimizer's own op redistributes them. Two consequences, both handled here:

- **Partial grads are summed before the check** (``sum_partial_grads``): a piece is not the grad,
  so neither its square nor its inf/NaN check is the grad's (two finite fp16 pieces may sum to
  inf). The sum is the all-reduce the optimizer would otherwise run in its step, moved forward
  (DTensor's ``redistribute``, the same op), so it adds no collective to the iteration.
- **The gate's squared norm is weighted** (``norm_weights``): each rank's local squared norm
  counts ``1 / (ranks holding a copy)``, the product of the mesh sizes over its ``Replicate``
  dims, so that the sum over the ranks in the one collective is the global squared norm: a
  replicated param counts once, not once per TP rank, and HSDP's replicas once, not sqrt(2).

Both are worked out once per param set (the ids of the params holding a grad, with the grads'
placements as first seen) and kept per optimizer; a step reads them back. A grad that is a plain
tensor weighs 1 (the gate cannot know that DDP replicated it: its norm stays sqrt(world) times the
true one there, a constant factor). The weights count the copies on the grad's own mesh, so the
norm is global when the scaler's group is that mesh's ranks (the default, the world); over a
larger group (DDP around a TP mesh) the replicas outside the mesh count as under DDP.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from dscale import _dist
from dscale.scaler._program.unscale import DTensor


class ParamSet:
    """One optimizer's params with grads, as last seen: their ids, sqrt weights, Partial ones."""

    def __init__(self, key: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        self.key = key
        self.partial: list[int] = []  # positions of the grads whose placements hold a Partial
        self.on_a_mesh = False  # whether any grad is a DTensor
        roots: list[float] = []
        for position, grad in enumerate(grads):
            copies = 1
            if DTensor is not None and isinstance(grad, DTensor):
                self.on_a_mesh = True
                mesh = grad.device_mesh
                if any(p.is_partial() for p in grad.placements):  # summed into Replicate first
                    self.partial.append(position)
                for dim, placement in enumerate(grad.placements):
                    if placement.is_replicate() or placement.is_partial():
                        copies *= mesh.size(dim)
            roots.append(math.sqrt(1.0 / copies))
        # sqrt of each weight (the norms are multiplied before they are squared); None: all 1
        self.roots = (
            None if all(r == 1.0 for r in roots) else torch.tensor(roots, dtype=torch.float64)
        )
        self._placed: dict[torch.device, torch.Tensor] = {}

    def roots_on(self, device: torch.device) -> torch.Tensor | None:
        """sqrt of each grad's weight in the gate's squared norm, in the optimizer's order (fp64).

        None when every weight is 1 (plain tensors, or DTensors sharded on every mesh dim).
        """
        if self.roots is None:
            return None
        if device not in self._placed:
            self._placed[device] = self.roots.to(device)
        return self._placed[device]


_sets: weakref.WeakKeyDictionary[torch.optim.Optimizer, ParamSet] = weakref.WeakKeyDictionary()


def _param_set(optimizer: torch.optim.Optimizer) -> tuple[list[Any], ParamSet | None]:
    """The params holding a grad, and their set (None when no grad is a DTensor: nothing to
    weigh or sum)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    key = tuple(map(id, params))
    known = _sets.get(optimizer)
    if known is None or known.key != key:  # plain tensors too: a step never looks at each grad
        known = _sets[optimizer] = ParamSet(key, [p.grad for p in params])
    return params, (known if known.on_a_mesh else None)


def sum_partial_grads(optimizer: torch.optim.Optimizer) -> ParamSet | None:
    """Replace every ``Partial`` DTensor grad of ``optimizer`` by its sum (``Replicate``).

    The all-reduce is the one the optimizer's step would run on such a grad anyway. Only the
    Partial grads are visited (the norms' under sequence parallel), once per step. Returns the
    param set (None when no grad is a DTensor), whose :meth:`ParamSet.roots_on` gives the
    gate's weights.
    """
    params, found = _param_set(optimizer)
    if found is None or not found.partial:
        return found
    for position in found.partial:
        param = params[position]
        param.grad = _dist.sum_partial(param.grad)
    return found
