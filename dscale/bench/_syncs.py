"""Count host syncs of one call on CUDA with torch's sync debug mode.

``torch.cuda.set_sync_debug_mode("warn")`` emits one warning per synchronizing CUDA operation
(``.item()``, a blocking device-to-host copy, ``nonzero``...); counting those warnings counts the
syncs. Only meaningful on CUDA; on the CPU there is no host/device boundary to count.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many synchronizing CUDA operations ``fn`` performs (needs CUDA)."""
    if not torch.cuda.is_available():
        raise RuntimeError("count_host_syncs needs CUDA: the CPU has no host syncs to count")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # One warning per synchronizing operation; torch also warns once that the mode is a
    # prototype ("Synchronization debug mode is a prototype feature ..."): not a sync.
    return sum(str(w.message).startswith(_SYNC_WARNING) for w in caught)


_SYNC_WARNING = "called a synchronizing CUDA operation"
