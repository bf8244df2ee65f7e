"""dscale-launch: a Hydra launcher over torchrun that runs your training function on every rank.

``get_context()`` gives a ``script=`` (or any code under an entrypoint) the run context.

The names below are imported on first use, so that ``python -m launch`` can install its SIGTERM
handler before torch loads (``launch/startup.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launch.context import RunContext
    from launch.worker import get_context

__all__ = ["RunContext", "get_context"]

_LAZY = {"RunContext": "launch.context", "get_context": "launch.worker"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'launch' has no attribute {name!r}")
