"""dscale in Lightning Fabric: precision plugins, and FSDP strategies whose load() restores.

Example::

    from dscale.integrations import fabric as dscale_fabric

    scaler = dscale.GradScaler("cpu")  # or "cuda"
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp",
                    plugins=[dscale_fabric.MixedPrecision(scaler)])
    ...
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
    optimizer.step()                      # skipped on every rank when any rank overflowed
    if scaler.step_applied():             # hold the LR schedule on skipped steps
        scheduler.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "scaler": scaler})

Lightning 2.6 limits worked around here: ``FSDPPrecision(scaler=...)`` raises for any scaler and
its autocast is hard-coded to "cuda"; ``ModelParallelStrategy`` refuses ``precision="16-mixed"``
as a string (a plugin instance is accepted), and its sharded ``load`` (ModelParallelStrategy,
FSDPStrategy) hands back the scaler's state as a dict instead of loading it. Not worked around:
``clip_gradients`` raises on an overflow step unless ``error_if_nonfinite=False``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
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
from lightning.fabric.plugins.precision import FSDPPrecision as _FSDPPrecision  # noqa: E402
from lightning.fabric.plugins.precision import HalfPrecision as _HalfPrecision  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision as _MixedPrecision  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy as _FSDPStrategy  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy as _ModelParallel  # noqa: E402

__all__ = [
    "FSDPPrecision",
    "FSDPStrategy",
    "MasterWeightsPrecision",
    "MixedPrecision",
    "ModelParallelStrategy",
]


class MixedPrecision(_MixedPrecision):  # type: ignore[misc]
    """Fabric's "16-mixed" with a ``dscale.GradScaler``; autocast on the scaler's device.

    Also unscales fused optimizers' grads for clipping (dscale's fused step then takes them
    unscaled), which Lightning's plugin refuses. "bf16-mixed" needs no scaler: said once, unused.
    """

    def __init__(
        self,
        scaler: GradScaler | None,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
    ) -> None:
        kept = scaler_for(scaler, precision, "dscale.integrations.fabric.MixedPrecision")
        default = scaler._device if scaler is not None else _default_device()
        super().__init__(precision=precision, device=device or default, scaler=kept)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        unscale_if_scaled(self.scaler, optimizer)


class FSDPPrecision(_FSDPPrecision):  # type: ignore[misc]
    """Fabric's FSDPPrecision taking a ``dscale.GradScaler`` for "16-mixed" (FSDP1 and FSDP2).

    Lightning 2.6's own ``__init__`` raises for any scaler and its autocast is "cuda" only; this
    one keeps the scaler and autocasts on the scaler's device.
    """

    def __init__(
        self,
        scaler: GradScaler | None,
        precision: Literal["16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true"] = (
            "16-mixed"
        ),
    ) -> None:
        init_fsdp_precision(self, scaler, precision, "dscale.integrations.fabric.FSDPPrecision")

    def forward_context(self) -> AbstractContextManager[Any]:
        autocast = mixed_autocast(self)
        return autocast if autocast is not None else super().forward_context()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        unscale_if_scaled(self.scaler, optimizer)


class MasterWeightsPrecision(_HalfPrecision):  # type: ignore[misc]
    """ "16-true" with fp32 master weights: ``dscale.FP16Optimizer`` behind Fabric's optimizer.

    Fabric only sets up real ``torch.optim.Optimizer`` objects, so pass yours through
    :meth:`wrap` (it gains fp32 masters in place) and set up what it returns::

        precision = MasterWeightsPrecision()
        fabric = Fabric(..., plugins=[precision])
        model = fabric.setup_module(model)                  # fp16 weights
        optimizer = fabric.setup_optimizers(precision.wrap(torch.optim.AdamW(model.parameters())))
        fabric.backward(loss)   # scaled; grads copied to the masters and unscaled
        optimizer.step()        # masters updated (or skipped on every rank), model refreshed

    Save ``"precision": precision`` with the checkpoint: it holds the masters and the scaler.
    """

    def __init__(self, dynamic_loss_args: Mapping[str, Any] | None = None) -> None:
        super().__init__("16-true")
        self._masters = MasterWeights(
            dynamic_loss_args, "dscale.integrations.fabric.MasterWeightsPrecision"
        )

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Give ``optimizer`` fp32 master weights; returns the same optimizer."""
        return self._masters.wrap(optimizer)

    def fp16_optimizer(self, optimizer: Any) -> Any:
        """The ``dscale.FP16Optimizer`` behind ``optimizer`` (its ``overflow`` says skipped)."""
        return self._masters.of(optimizer)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        self._masters.only().backward(tensor, retain_graph=kwargs.get("retain_graph", False))

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self._masters.step(optimizer)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """The masters' grads are unscaled by backward() already."""

    def state_dict(self) -> dict[str, Any]:
        return self._masters.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._masters.load_state_dict(state_dict)


class _RestoresStatefulOnLoad:
    """A Fabric strategy whose sharded ``load`` restores stateful objects in place.

    Lightning 2.6's sharded-checkpoint load (ModelParallelStrategy, FSDPStrategy) puts the saved
    dict where the object was (the scaler, a precision plugin) instead of calling its
    ``load_state_dict``; this loads it and puts the object back.
    """

    def load_checkpoint(
        self,
        path: str | Path,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        stateful = {}
        if isinstance(state, dict):
            stateful = {
                key: obj
                for key, obj in state.items()
                if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
                and callable(getattr(obj, "load_state_dict", None))
                and callable(getattr(obj, "state_dict", None))
            }
        remainder: dict[str, Any] = super().load_checkpoint(  # type: ignore[misc]
            path, state, strict=strict, weights_only=weights_only
        )
        for key, obj in stateful.items():
            loaded = state.get(key)
            if loaded is not obj and isinstance(loaded, Mapping):
                obj.load_state_dict(loaded)
                state[key] = obj
        return remainder


class ModelParallelStrategy(_RestoresStatefulOnLoad, _ModelParallel):  # type: ignore[misc]
    """Fabric's ModelParallelStrategy (FSDP2 / TP) whose ``load`` restores stateful objects.

    Pass it as ``Fabric(strategy=ModelParallelStrategy(parallelize_fn), ...)``.
    """


class FSDPStrategy(_RestoresStatefulOnLoad, _FSDPStrategy):  # type: ignore[misc]
    """Fabric's FSDPStrategy (FSDP1) whose sharded ``load`` restores stateful objects.

    Pass it as ``Fabric(strategy=FSDPStrategy(...), plugins=[FSDPPrecision(scaler)])``.
    """
