"""Count what one training iteration dispatches: kernel-launching ops, host reads, collectives.

On a GPU every dispatched op that computes something is a kernel launch (5-10 us of host time),
and a host read of a device value (``.item()``, ``.tolist()``, a device-to-host copy) stalls the
host until the GPU catches up. Both are properties of the code, not of the machine, so they are
counted deterministically with a ``TorchDispatchMode`` (every aten op that reaches a kernel) and a
``TorchFunctionMode`` (``tolist``, which reads without dispatching), and CI can hold them on the
CPU. Views, allocations without a fill, and shape queries launch nothing and are not counted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel: allocation without a fill, metadata, and the host read (counted
# as a read). Views are recognised by their schema (OpOverload.is_view).
_NO_KERNEL = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "record_stream",
    }
)
_HOST_READ = "_local_scalar_dense"
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
# Tensor methods that read device memory on the host without dispatching an aten op.
_HOST_READ_METHODS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy})


@dataclasses.dataclass
class OpCounts:
    """What a counted region dispatched."""

    kernels: Counter[str] = dataclasses.field(default_factory=Counter)
    host_reads: int = 0
    collectives: int = 0

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(
            self.kernels + other.kernels,
            self.host_reads + other.host_reads,
            self.collectives + other.collectives,
        )

    def scaled(self, factor: float) -> dict[str, Any]:
        """Per-iteration figures as plain numbers (``factor`` = 1 / iterations)."""
        return {
            "kernels": self.num_kernels * factor,
            "host_reads": self.host_reads * factor,
            "collectives": self.collectives * factor,
            "by_op": {k: v * factor for k, v in sorted(self.kernels.items())},
        }


def _reads_device(args: tuple[Any, ...], host_only: bool) -> bool:
    """Whether a read of ``args[0]`` waits for a device: always, when every tensor is on the host
    (the CPU stands in for the device there); else only for a tensor that is not on the CPU."""
    tensor = args[0] if args else None
    return host_only or (isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu")


def _blocking_copy_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A device-to-host copy that waits for the device (a non_blocking one into pinned memory
    does not). Only a real device has one; on the CPU stand-in the flag is read with item()."""
    if name == "_to_copy":
        source, target = args[0], kwargs.get("device")
        non_blocking = kwargs.get("non_blocking", False)
    else:
        target_tensor, source = args[0], args[1]
        target = target_tensor.device if isinstance(target_tensor, torch.Tensor) else None
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if not isinstance(source, torch.Tensor) or target is None:
        return False
    return source.device.type != "cpu" and torch.device(target).type == "cpu" and not non_blocking


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: OpCounts, host_only: bool) -> None:
        super().__init__()
        self.counts = counts
        self.host_only = host_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.counts.collectives += 1
        elif name == _HOST_READ:
            self.counts.host_reads += _reads_device(args, self.host_only)
        elif name in ("_to_copy", "copy_") and _blocking_copy_to_host(name, args, kwargs or {}):
            self.counts.host_reads += 1
        elif not (func.is_view or name in _NO_KERNEL):
            self.counts.kernels[name] += 1
        return func(*args, **(kwargs or {}))


class _ReadCounter(TorchFunctionMode):
    def __init__(self, counts: OpCounts, host_only: bool) -> None:
        super().__init__()
        self.counts = counts
        self.host_only = host_only

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _HOST_READ_METHODS:
            self.counts.host_reads += _reads_device(args, self.host_only)
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object], *, host_only: bool | None = None) -> OpCounts:
    """Run ``fn()`` once and count what it dispatched on this thread (autograd's included).

    ``host_only`` (default: no CUDA here): every tensor is on the CPU, standing in for a device,
    so every host read counts; with CUDA only reads of device memory count (a read of a pinned
    buffer whose copy has landed waits for nothing).
    """
    counts = OpCounts()
    if host_only is None:
        host_only = not torch.cuda.is_available()
    with _ReadCounter(counts, host_only), _DispatchCounter(counts, host_only):
        fn()
    return counts


def count_cuda_kernels(fn: Callable[[], object]) -> int:
    """Run ``fn()`` under torch's profiler and count what ran on the GPU: kernels, memcpy, memset.

    The device's own count, to hold the dispatch count against: a foreach op over many tensors
    launches one kernel per chunk, and some ops launch none on the device they dispatch for.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and not _is_annotation(event)
    )


def _is_annotation(event: Any) -> bool:
    # The profiler can report user annotations on the device timeline too; they launch nothing.
    return str(getattr(event, "name", "")).startswith(("ProfilerStep", "## "))
