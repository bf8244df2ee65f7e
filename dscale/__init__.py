"""dscale: distributed dynamic loss scaling for PyTorch."""

from dscale.master_weights import (
    FP16Optimizer,
    master_params_to_model_params,
    model_grads_to_master_grads,
    prep_param_lists,
)
from dscale.scaler import GradObserver, GradScaler, ScaleCollapsedError
from dscale.step_guard import StepGuard

__version__ = "0.1.0"

__all__ = [
    "FP16Optimizer",
    "GradObserver",
    "GradScaler",
    "ScaleCollapsedError",
    "StepGuard",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "prep_param_lists",
]
