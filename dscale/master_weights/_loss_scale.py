"""The two loss-scale modes of FP16Optimizer: a fixed scale, or dscale's GradScaler.

Both expose the same small interface, so FP16Optimizer has no ``if dynamic`` branches. The dynamic
mode hands the overflow check, the cross-rank agreement and the skip decision to
:class:`dscale.GradScaler`; nothing here looks for infs itself.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dscale.scaler import GradScaler

# apex's DynamicLossScaler names -> what they mean for GradScaler. scale_factor is both the growth
# factor and the inverse of the backoff factor in apex.
APEX_NAMES = ("init_scale", "scale_factor", "scale_window")


class StaticLossScale:
    """A fixed scale, as apex's ``LossScaler``: every step is applied, no overflow check."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self.value = scale

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, scale: float) -> None:
        self._value = check_static_scale(scale, "static_loss_scale")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self._value

    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
        if grads and self._value != 1.0:
            torch._foreach_mul_(grads, 1.0 / self._value)

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> bool:
        optimizer.step(closure)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self._value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = state["loss_scale"]


class DynamicLossScale:
    """Dynamic scaling by :class:`dscale.GradScaler`; skipped steps are agreed across ranks."""

    dynamic = True

    def __init__(self, device: str, dynamic_loss_args: Mapping[str, Any] | None) -> None:
        kwargs = scaler_kwargs(dynamic_loss_args)
        kwargs.setdefault("device", device)
        try:
            self.scaler = GradScaler(**kwargs)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"dynamic_loss_args={dict(dynamic_loss_args or {})!r}: {exc}") from exc

    @property
    def value(self) -> float:
        return float(self.scaler.get_scale())

    @value.setter
    def value(self, scale: float) -> None:
        # GradScaler has no public setter for the scale; its state dict is the public way in.
        state = self.scaler.state_dict()
        state["scale"] = check_static_scale(scale, "loss_scale")
        self.scaler.load_state_dict(state)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss.float())

    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> bool:
        if closure is not None:
            raise ValueError(
                "step(closure=...) is not supported with dynamic_loss_scale=True: a skipped step "
                "would need the closure re-run at a lower scale (apex refuses it too). Call "
                "backward() and step() yourself, or use a static_loss_scale"
            )
        self.scaler.step(optimizer)
        applied = bool(self.scaler.step_applied(optimizer))
        self.scaler.update()
        return applied

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])


def check_static_scale(scale: Any, name: str) -> float:
    """``scale`` as a float, or a ValueError naming ``name`` when it is not finite and > 0."""
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a finite number > 0, got {scale!r}; 1.0 means no scaling, "
            "powers of two (128.0, 1024.0) keep the unscale exact"
        )
    return value


def scaler_kwargs(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """Translate ``dynamic_loss_args`` (apex's names or GradScaler's) into GradScaler kwargs."""
    args = dict(args or {})
    accepted = set(inspect.signature(GradScaler.__init__).parameters) - {"self", "enabled"}
    unknown = sorted(set(args) - accepted - set(APEX_NAMES))
    if unknown:
        raise ValueError(
            f"dynamic_loss_args has unknown keys {unknown}; use apex's names "
            f"{list(APEX_NAMES)} or GradScaler's {sorted(accepted)}"
        )
    if "scale_factor" in args:
        clash = sorted({"growth_factor", "backoff_factor"} & set(args))
        if clash:
            raise ValueError(
                f"dynamic_loss_args gives scale_factor={args['scale_factor']!r} and {clash}; "
                "scale_factor (apex) sets both growth_factor and backoff_factor=1/scale_factor, "
                "so pass either scale_factor or GradScaler's names"
            )
        factor = args.pop("scale_factor")
        try:
            backoff = 1.0 / float(factor)
        except (TypeError, ValueError, ZeroDivisionError):
            raise ValueError(
                f"dynamic_loss_args['scale_factor'] must be a number > 1, got {factor!r}"
            ) from None
        args["growth_factor"] = factor
        args["backoff_factor"] = backoff
    if "scale_window" in args:
        if "growth_interval" in args:
            raise ValueError(
                f"dynamic_loss_args gives both scale_window={args['scale_window']!r} (apex) and "
                f"growth_interval={args['growth_interval']!r} (GradScaler); they are the same "
                "setting, pass one"
            )
        args["growth_interval"] = args.pop("scale_window")
    return args
