"""dscale in the Lightning Trainer: precision plugins that take a ``dscale.GradScaler``.

Example::

    from dscale.integrations.lightning import MixedPrecision

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        plugins=[MixedPrecision(dscale.GradScaler("cpu"))])

Pass the plugin instance, not ``precision="16-mixed"``: on CPU Lightning 2.6 turns that string into
bf16 with a warning. What the plugins add over Lightning's own with dscale's scaler in them: every
rank skips together (dscale), the LR schedulers with ``interval="step"`` hold on skipped steps
(Lightning steps them regardless), clipping works with fused optimizers, and the scaler state is
saved in the checkpoint under the plugin's class name and restored on resume.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal

from dscale.integrations._lightning_common import (
    MasterWeights,
    init_fsdp_precision,
    mixed_autocast,
    require_lightning,
    scaler_for,
    unscale_if_scaled,
)
from dscale.integrations._lightning_common import (
    default_device as _default_device,
)
from dscale.scaler import GradScaler

require_lightning()

import torch  # noqa: E402
from lightning.pytorch.plugins.precision import FSDPPrecision as _FSDPPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import HalfPrecision as _HalfPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _MixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import Precision as _Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

__all__ = ["FSDPPrecision", "MasterWeightsPrecision", "MixedPrecision"]

# scheduler -> "was its optimizer's last step skipped?"; weak, and outside the scheduler's
# __dict__ so that its state_dict() (saved in checkpoints) stays as it was.
_HOLDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_HELD_CLASSES: dict[type, type] = {}


def _held_class(cls: type) -> type:
    if cls not in _HELD_CLASSES:

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            skipped = _HOLDS.get(self)
            if skipped is not None and skipped():
                return None  # the optimizer did not move: neither does the schedule
            return cls.step(self, *args, **kwargs)  # type: ignore[attr-defined]

        namespace = {"step": step, "__module__": cls.__module__}
        _HELD_CLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return _HELD_CLASSES[cls]


def hold_on_skipped_steps(lr_scheduler_configs: list[Any], skipped: Any) -> None:
    """Make each ``interval="step"`` scheduler skip its step when ``skipped(optimizer)`` is True."""
    for config in lr_scheduler_configs:
        scheduler = config.scheduler
        optimizer = getattr(scheduler, "optimizer", None)
        if config.interval != "step" or optimizer is None:
            continue
        _HOLDS[scheduler] = lambda opt=optimizer: skipped(opt)
        scheduler.__class__ = _held_class(type(scheduler))


def _scaler_skipped(scaler: Any) -> Any:
    def skipped(optimizer: Any) -> bool:
        if scaler is None or not scaler.is_enabled():
            return False
        try:  # after a fused or sync-free step this reads the agreed flag (waits for the GPU)
            return not scaler.step_applied(optimizer)
        except RuntimeError:  # not stepped by the scaler yet
            return False

    return skipped


class MixedPrecision(_MixedPrecision):  # type: ignore[misc]
    """The Trainer's "16-mixed" with a ``dscale.GradScaler``; autocast on the scaler's device.

    "bf16-mixed" needs no scaler: said once, the scaler is not used.
    """

    def __init__(
        self,
        scaler: GradScaler | None,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
    ) -> None:
        kept = scaler_for(scaler, precision, "dscale.integrations.lightning.MixedPrecision")
        default = scaler._device if scaler is not None else _default_device()
        super().__init__(precision=precision, device=device or default, scaler=kept)

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        hold_on_skipped_steps(lr_schedulers, _scaler_skipped(self.scaler))
        return super().connect(model, optimizers, lr_schedulers)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Lightning refuses clipping with fused optimizers; dscale unscales them like any other.
        if clip_val > 0:
            unscale_if_scaled(self.scaler, optimizer)
        _Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class FSDPPrecision(_FSDPPrecision):  # type: ignore[misc]
    """The Trainer's FSDPPrecision taking a ``dscale.GradScaler`` for "16-mixed".

    Lightning 2.6's own ``__init__`` raises for any scaler and its autocast is "cuda" only; this
    one keeps the scaler and autocasts on the scaler's device. (Lightning's FSDPStrategy itself
    needs a GPU.)
    """

    def __init__(
        self,
        scaler: GradScaler | None,
        precision: Literal["16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true"] = (
            "16-mixed"
        ),
    ) -> None:
        init_fsdp_precision(self, scaler, precision, "dscale.integrations.lightning.FSDPPrecision")

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        hold_on_skipped_steps(lr_schedulers, _scaler_skipped(self.scaler))
        return super().connect(model, optimizers, lr_schedulers)

    def forward_context(self) -> AbstractContextManager[Any]:
        autocast = mixed_autocast(self)
        return autocast if autocast is not None else super().forward_context()


class MasterWeightsPrecision(_HalfPrecision):  # type: ignore[misc]
    """ "16-true" with fp32 master weights: each optimizer becomes a ``dscale.FP16Optimizer``.

    The model's weights are fp16; at setup the optimizers from ``configure_optimizers`` gain fp32
    masters (in place, so Lightning keeps handling the same objects), backward scales the loss
    and copies the grads to the masters, and the step updates the masters (or skips on every
    rank) and rounds them into the model. The checkpoint holds the masters and the scaler.
    """

    def __init__(self, dynamic_loss_args: Mapping[str, Any] | None = None) -> None:
        super().__init__("16-true")
        self._masters = MasterWeights(
            dynamic_loss_args, "dscale.integrations.lightning.MasterWeightsPrecision"
        )

    def fp16_optimizer(self, optimizer: Any) -> Any:
        """The ``dscale.FP16Optimizer`` behind ``optimizer`` (its ``overflow`` says skipped)."""
        return self._masters.of(optimizer)

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        for optimizer in optimizers:
            self._masters.wrap(optimizer)
        hold_on_skipped_steps(lr_schedulers, lambda opt: self._masters.of(opt).overflow)
        return super().connect(model, optimizers, lr_schedulers)

    def backward(
        self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        fp16 = self._masters.only() if optimizer is None else self._masters.of(optimizer)
        fp16.backward(tensor, retain_graph=kwargs.get("retain_graph", False))

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Any, **kwargs: Any
    ) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        self._masters.step(optimizer)
        return closure_result

    def state_dict(self) -> dict[str, Any]:
        return self._masters.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._masters.load_state_dict(state_dict)
