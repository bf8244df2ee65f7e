"""dscale: distributed dynamic loss scaling for PyTorch."""

from dscale.scaler import GradObserver, GradScaler, ScaleCollapsedError

__version__ = "0.1.0"

__all__ = [
    "GradObserver",
    "GradScaler",
    "ScaleCollapsedError",
]
