"""What every integration checks first: the framework's version, and whether scaling is on."""

from __future__ import annotations

import re
import warnings
from importlib import metadata

import torch

__all__ = ["check_scaler", "require_version", "say_once"]

_said: set[str] = set()


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def require_version(package: str, lowest: str, below: str, extra: str) -> None:
    """Raise a RuntimeError naming the supported range unless ``lowest <= package < below``.

    The range is the one this integration's tests ran on: the framework internals it relies on
    (documented in the module) may move in another release.
    """
    try:
        found = metadata.version(package)
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            f"dscale.integrations needs {package} >={lowest},<{below}, which is not installed: "
            f"pip install 'dscale[{extra}]'"
        ) from None
    if not (_release(lowest) <= _release(found) < _release(below)):
        raise RuntimeError(
            f"dscale.integrations supports {package} >={lowest},<{below}; found {package} {found}. "
            f"Install a supported version (pip install 'dscale[{extra}]'), or use "
            "dscale.GradScaler directly in your own loop"
        )


def say_once(message: str) -> None:
    """Warn with ``message`` once per process (a config read in a loop must not flood the log)."""
    if message not in _said:
        _said.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def check_scaler(scaler: object, where: str) -> bool:
    """True when ``scaler`` scales; False (said once) for a disabled one, which passes through.

    Raises:
        TypeError: ``scaler`` is not a ``dscale.GradScaler``.
    """
    from dscale.scaler import GradScaler

    if not isinstance(scaler, GradScaler):
        kind = "torch's GradScaler" if isinstance(scaler, torch.amp.GradScaler) else "a"
        raise TypeError(
            f"{where} takes a dscale.GradScaler, got {kind} {type(scaler).__name__}; build one "
            "with dscale.GradScaler(device, ...) (the same arguments as torch's)"
        )
    if not scaler.is_enabled():
        say_once(
            f"{where}: the dscale.GradScaler is disabled (enabled=False, or device='cuda' without "
            "CUDA), so it passes every step through unscaled and unchecked"
        )
        return False
    return True
