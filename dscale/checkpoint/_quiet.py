"""Silence DCP's single-process warning, which fires on every call even with ``no_dist=True``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["quiet_single_process"]


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group, saving "in a single process" is exactly what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
