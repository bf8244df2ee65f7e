"""What the Trainer and Fabric plugins share: the version gate, the scaler check, master weights."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from dscale.integrations._support import check_scaler, require_version, say_once
from dscale.master_weights import FP16Optimizer
from dscale.scaler import GradScaler

SUPPORTED = ("2.6", "2.7")  # lightning >=2.6,<2.7: what the tests ran on

# FSDPPrecision's dtypes by precision (Lightning's table, copied: its __init__ cannot be called).
FSDP_INPUT_DTYPES = {
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "32-true": torch.float32,
}


def require_lightning() -> None:
    require_version("lightning", *SUPPORTED, extra="lightning")


def default_device() -> str:
    """Where autocast runs when no scaler names a device (bf16 without a scaler)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def scaler_for(scaler: GradScaler | None, precision: str, where: str) -> GradScaler | None:
    """The scaler a plugin should use: ``scaler``, or None (said once) where none is needed.

    Raises:
        TypeError: ``scaler`` is not a ``dscale.GradScaler``.
        ValueError: "16-mixed" without a scaler.
    """
    if precision != "16-mixed":
        if scaler is not None:
            check_scaler(scaler, where)
            say_once(
                f"{where}: precision={precision!r} needs no loss scaler (bf16 and fp32 have "
                "fp32's range); the dscale.GradScaler is not used"
            )
        return None
    if scaler is None:
        raise ValueError(
            f"{where}: precision='16-mixed' needs a scaler; pass scaler=dscale.GradScaler(device)"
        )
    check_scaler(scaler, where)  # a disabled one is said once and kept: it passes through
    return scaler


def init_fsdp_precision(plugin: Any, scaler: GradScaler | None, precision: str, where: str) -> None:
    """Set up an FSDPPrecision plugin (Trainer's or Fabric's) as Lightning's ``__init__`` would.

    Lightning 2.6's own ``__init__`` raises for any scaler, so it is not called; this keeps the
    scaler and autocasts on the scaler's device (Lightning's is "cuda" only).
    """
    if precision not in FSDP_INPUT_DTYPES:
        raise ValueError(
            f"precision={precision!r} is not an FSDP precision; use one of "
            f"{sorted(FSDP_INPUT_DTYPES)}"
        )
    plugin.scaler = scaler_for(scaler, precision, where)
    plugin.precision = precision
    plugin._desired_input_dtype = FSDP_INPUT_DTYPES[precision]
    plugin._autocast_device = scaler._device if scaler is not None else "cuda"


def mixed_autocast(plugin: Any) -> AbstractContextManager[Any] | None:
    """fp16 or bf16 autocast on the plugin's device for a "mixed" precision; None otherwise."""
    if "mixed" not in plugin.precision:
        return None
    dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
    return torch.autocast(plugin._autocast_device, dtype=dtype)


def unscale_if_scaled(scaler: Any, optimizer: Any) -> None:
    """Unscale ``optimizer``'s grads unless done this iteration (fused optimizers included).

    Lightning refuses this for fused optimizers (they unscale inside their step with torch's
    scaler); dscale's fused step takes grads that were unscaled already.
    """
    if scaler is None or not scaler.is_enabled():
        return
    from torch.amp.grad_scaler import OptState

    states: Any = scaler._per_optimizer_states
    if states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


class MasterWeights:
    """The FP16Optimizers behind a "16-true" plugin, found by the torch optimizer they wrap."""

    def __init__(self, dynamic_loss_args: Mapping[str, Any] | None, where: str) -> None:
        self.dynamic_loss_args = dict(dynamic_loss_args or {})
        self.where = where
        self.wrapped: dict[int, FP16Optimizer] = {}

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Give ``optimizer`` fp32 masters (in place) and return it."""
        if id(optimizer) not in self.wrapped:
            self.wrapped[id(optimizer)] = FP16Optimizer(
                optimizer, dynamic_loss_scale=True, dynamic_loss_args=self.dynamic_loss_args
            )
        return optimizer

    def of(self, optimizer: Any) -> FP16Optimizer:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        found = self.wrapped.get(id(inner))
        if found is None:
            raise ValueError(
                f"{self.where}: optimizer {type(inner).__name__} has no fp32 master weights; "
                "pass it through the plugin's wrap(optimizer) before training"
            )
        return found

    def step(self, optimizer: Any) -> None:
        """Step the masters (or skip on every rank), then clear every grad of this iteration.

        The framework's ``zero_grad()`` reaches only the torch optimizer (the masters), so the
        model's 16-bit grads are cleared here; else they would pile up across iterations.
        """
        fp16 = self.of(optimizer)
        fp16.step()
        fp16.zero_grad(set_to_none=True)

    def only(self) -> FP16Optimizer:
        if len(self.wrapped) != 1:
            raise ValueError(
                f"{self.where}: backward() cannot tell which of {len(self.wrapped)} wrapped "
                "optimizers this loss belongs to; use one optimizer per plugin (or none was "
                "wrapped: call wrap(optimizer))"
            )
        return next(iter(self.wrapped.values()))

    def state_dict(self) -> dict[str, Any]:
        return {"fp16_optimizers": [opt.state_dict() for opt in self.wrapped.values()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("fp16_optimizers", [])
        if len(saved) != len(self.wrapped):
            raise ValueError(
                f"{self.where}: the checkpoint holds {len(saved)} master-weight optimizer states "
                f"but {len(self.wrapped)} optimizers were wrapped; wrap the same optimizers first"
            )
        for opt, opt_state in zip(self.wrapped.values(), saved, strict=True):
            opt.load_state_dict(opt_state)
