"""A flat copy of many tensors, and putting it back where a device-side flag says, in a few ops.

``sync_free`` undoes a skipped step on the device. Done per tensor, that is three ops per
parameter and per state tensor (clone, where, copy); here the tensors of one (device, dtype) are
gathered into one flat buffer by a single ``cat``, and restored by one ``cat``, one ``where`` and
one ``_foreach_copy_``: four launches per group, whatever the number of parameters.

Memory: one flat copy of the tensors (kept between steps, so it is allocated once), and during a
restore a second, transient one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlatSnapshot:
    """Flat per-(device, dtype) copies of a fixed list of contiguous tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.ids = list(map(id, tensors))
        # `p.data = ...` keeps the object and moves its storage: the views must follow.
        self.addresses = list(map(torch.Tensor.data_ptr, tensors))
        # Per group: flat views of its tensors, their sizes, its buffer, their list positions.
        self._groups: list[tuple[list[torch.Tensor], list[int], torch.Tensor, list[int]]] = []
        grouped = torch._C._group_tensors_by_device_and_dtype([list(tensors)], True)
        for (device, dtype), (lists, positions) in grouped.items():
            members: list[torch.Tensor] = list(lists[0])  # type: ignore[arg-type]
            flat = [t.view(-1) for t in members]
            sizes = [t.numel() for t in flat]
            buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
            self._groups.append((flat, sizes, buffer, list(positions)))

    def covers(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether this snapshot was made for exactly these tensor objects and storages."""
        return self.ids == list(map(id, tensors)) and self.addresses == list(
            map(torch.Tensor.data_ptr, tensors)
        )

    @staticmethod
    def fits(tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every item is a dense, contiguous tensor (what a flat view needs)."""
        return all(
            type(t) in _PLAIN and t.is_contiguous() and t.layout is torch.strided for t in tensors
        )

    def save(self) -> None:
        """Copy the tensors' current values into the buffers: one op per group."""
        for flat, _, buffer, _ in self._groups:
            torch.cat(flat, out=buffer)

    def restore_where(
        self,
        mask_on: dict[torch.device, torch.Tensor],
        into: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Put the saved values back wherever ``mask_on[device]`` (a 0-d bool) is set.

        ``into``: the tensors to restore when they are no longer the saved ones (an optimizer
        that rebinds its state to new tensors of the same shapes), in the saved order.
        """
        for flat, sizes, buffer, positions in self._groups:
            if into is not None:
                flat = [into[i].view(-1) for i in positions]
            now = torch.cat(flat)
            torch.where(mask_on[buffer.device], buffer, now, out=now)
            torch._foreach_copy_(flat, now.split(sizes))

    @property
    def devices(self) -> set[torch.device]:
        return {buffer.device for _, _, buffer, _ in self._groups}


_PLAIN = (torch.Tensor, torch.nn.Parameter)
