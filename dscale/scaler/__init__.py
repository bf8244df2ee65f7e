"""GradScaler: torch's API over a device program, with every rank taking the same decision.

``_api`` keeps torch's methods and the per-optimizer stage machine (the host orchestration);
``_check`` and ``_decision`` are its stages, ``_torch_compat`` torch's private surface.
``_program/`` is the device program: tensor functions over the scaler's state buffer and the
agreement vector. ``_state/`` is where the scale lives, the state dict, snapshot and counters;
``_attach/`` is the check folded into DDP's / FSDP2's gradient reduction.
"""

from dscale.scaler._api import GradObserver, GradScaler, ScaleCollapsedError

__all__ = ["GradObserver", "GradScaler", "ScaleCollapsedError"]

# Named by their public path (in reprs, messages and pickles), as torch names its classes.
for _public in (GradObserver, GradScaler, ScaleCollapsedError):
    _public.__module__ = __name__
del _public
