"""What an optimizer's parameters are to the models attach() hooked, kept between steps.

step() under attach() asks, each iteration, which attached models hold the optimizer's parameters
and whether every parameter is attached. Both only change with the optimizer's param_groups (or
the attached models), so they are worked out once, in one pass, and checked per step in O(groups):
nothing per parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Protocol, TypeVar

import torch


class _Holder(Protocol):
    """An attached model's hook state: the ids of the parameters its hooks reduce."""

    @property
    def ids(self) -> frozenset[int]: ...


S = TypeVar("S", bound=_Holder)


@dataclasses.dataclass
class ParamSet(Generic[S]):
    """What an optimizer's parameters are to the attached models, kept until they change.

    ``groups``: the optimizer's ``params`` lists as seen (kept, so their ids cannot be reused),
    with their lengths; ``epoch``: the models attached then; ``relevant``: the models holding
    some of the parameters; ``all_attached``: every parameter is held by one; ``covered``: the
    ids held, returned as they are when every grad of those models is untouched.
    """

    groups: list[tuple[list[torch.nn.Parameter], int]]
    epoch: int
    relevant: list[S]
    all_attached: bool
    covered: frozenset[int]

    def matches(self, optimizer: torch.optim.Optimizer, epoch: int) -> bool:
        """Whether ``optimizer``'s param_groups are still these (O(groups), not O(params)).

        A list gained or lost a parameter, or a group was added: rebuilt. A parameter replaced in
        place in a list, at the same length, is not seen (that would take a pass over them all).
        """
        groups = optimizer.param_groups
        if epoch != self.epoch or len(groups) != len(self.groups):
            return False
        return all(
            g["params"] is seen and len(seen) == n
            for g, (seen, n) in zip(groups, self.groups, strict=True)
        )


def param_set(states: list[S], optimizer: torch.optim.Optimizer, epoch: int) -> ParamSet[S]:
    """Build ``optimizer``'s :class:`ParamSet` (one pass over its parameters)."""
    lists = [g["params"] for g in optimizer.param_groups]
    params = [p for ps in lists for p in ps]
    ids = {id(p) for p in params}
    relevant = [s for s in states if not s.ids.isdisjoint(ids)]
    attached = frozenset().union(*(s.ids for s in relevant)) & ids
    return ParamSet(
        groups=[(ps, len(ps)) for ps in lists],
        epoch=epoch,
        relevant=relevant,
        all_attached=len(attached) == len(ids),
        covered=frozenset(attached),
    )
