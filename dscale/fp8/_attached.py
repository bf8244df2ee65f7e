"""What dscale.fp8 attaches to a scaler: its fields on the agreement vector, its numerics.

The agreement fields (``WeightScales``' amaxes, ``Float8Numerics``' stats) ride the vector
through one :class:`FieldChain` per scaler: the scaler all-reduces the vector the *last* field
returned, so a field that kept the tensor its own ``append_to`` returned would read its local,
un-agreed values whenever another field appended after it. The chain hands every field the final
vector. ``Float8Numerics`` and ``Float8Fallback`` also record themselves here against their
scaler (weakly: nothing is kept alive), so ``dscale.metrics.start_exporter`` serves and
``MetricsLog`` logs the FP8 numerics of a job with no extra code.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

_numerics: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_fallback: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_chains: weakref.WeakKeyDictionary[Any, FieldChain] = weakref.WeakKeyDictionary()


class FieldChain:
    """dscale.fp8's agreement fields on one scaler, registered with it as one field.

    Each member appends in turn (``append_to``), then gets the vector that will be all-reduced
    (``agreed_vector``), where its values sit at the offset it appended at.
    """

    def __init__(self) -> None:
        self.members: list[Any] = []
        self.unregister: Callable[[], None] | None = None

    def append_to(self, vector: torch.Tensor, optimizer: Any) -> torch.Tensor:
        """Every member's values appended; each is told the final vector."""
        appended = []
        for member in self.members:
            out = member.append_to(vector, optimizer)
            if out is not vector:
                appended.append(member)
            vector = out
        for member in appended:
            member.agreed_vector(vector)  # the tensor the scaler all-reduces in place
        return vector


def add_field(scaler: Any, field: Any) -> Callable[[], None]:
    """Put ``field`` on ``scaler``'s agreement vector (after the fields already there).

    ``field`` has ``append_to(vector, optimizer)`` and ``agreed_vector(vector)``; returns an
    unregister function.
    """
    chain = _chains.get(scaler)
    if chain is None:
        chain = _chains[scaler] = FieldChain()
        chain.unregister = scaler.add_agreement_field(chain)
    chain.members.append(field)

    def remove() -> None:
        if field in chain.members:
            chain.members.remove(field)
        if not chain.members and _chains.get(scaler) is chain:
            del _chains[scaler]
            if chain.unregister is not None:
                chain.unregister()

    return remove


def attach_numerics(scaler: Any, numerics: Any) -> None:
    """Record ``numerics`` as ``scaler``'s (the latest one wins)."""
    _numerics[scaler] = numerics


def attach_fallback(scaler: Any, fallback: Any) -> None:
    """Record ``fallback`` as ``scaler``'s (the latest one wins)."""
    _fallback[scaler] = fallback


def detach(scaler: Any, obj: Any) -> None:
    """Forget ``obj`` (a closed numerics or fallback) if it is still ``scaler``'s."""
    for table in (_numerics, _fallback):
        if table.get(scaler) is obj:
            del table[scaler]


def numerics_of(scaler: Any) -> Any:
    """``scaler``'s ``Float8Numerics``, or None."""
    return _numerics.get(scaler)


def fallback_of(scaler: Any) -> Any:
    """``scaler``'s ``Float8Fallback``, or None."""
    return _fallback.get(scaler)
