"""FP32 master weights for fp16 models: apex's ``FP16_Optimizer`` workflow on dscale's scaler.

A model kept entirely in fp16 (``model.half()``) cannot be updated in fp16: an update smaller than
half an fp16 ULP of the weight rounds back to the old weight and is lost. So the optimizer updates
fp32 master copies, and the model gets the rounded masters after each step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dscale.master_weights import _state as _master_state
from dscale.master_weights._groups import swap_in_masters
from dscale.master_weights._loss_scale import DynamicLossScale, StaticLossScale
from dscale.master_weights._param_lists import (
    master_params_to_model_params,
    model_grads_to_master_grads,
)

logger = logging.getLogger(__name__)


class FP16Optimizer:
    """Wrap an optimizer over fp16 params so that it updates fp32 masters instead.

    fp16 (and bf16) params in ``optimizer``'s param groups are replaced by fp32 copies; fp32 params
    are used as they are; group order and hyperparameters are kept. ``backward`` scales the loss,
    copies the grads to the masters and unscales them; ``step`` updates the masters and rounds them
    into the model. With ``dynamic_loss_scale=True`` the scale, the overflow check and the skip
    decision are :class:`dscale.GradScaler`'s, so under DDP every rank skips the same steps.

    Args:
        optimizer: any torch optimizer built over the model's params.
        static_loss_scale: fixed scale used when ``dynamic_loss_scale`` is False. As in apex, a
            static scale has no overflow check: every step is applied.
        dynamic_loss_scale: let a GradScaler pick the scale and skip overflowing steps.
        dynamic_loss_args: GradScaler keyword arguments, or apex's ``init_scale``,
            ``scale_factor`` (growth factor, and 1/backoff factor), ``scale_window`` (growth
            interval). Unset keys take GradScaler's defaults (init_scale 2**16), not apex's.
        verbose: log (INFO) what was ingested; apex printed it.

    Attributes:
        optimizer: the wrapped optimizer; its param groups now hold the masters.
        fp16_groups, fp32_from_fp16_groups, fp32_from_fp32_groups: per param group, the model's
            16-bit params, their masters, and the fp32 params used as they are (apex's names).
        overflow: True when the last step() was skipped for inf/NaN grads (agreed by all ranks).

    Example::

        model = torch.nn.Linear(8, 8).half()
        optimizer = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  dynamic_loss_scale=True)
        loss = model(torch.randn(4, 8, dtype=torch.half)).float().pow(2).mean()
        optimizer.zero_grad()
        optimizer.backward(loss)      # replaces loss.backward()
        optimizer.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Mapping[str, Any] | None = None,
        verbose: bool = False,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "build it over the model's params first, then wrap it"
            )
        # Build (and so validate) the loss scale first: a rejected argument leaves `optimizer` as
        # it was.
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        device = first.device.type if first is not None else "cpu"
        if dynamic_loss_scale:
            self._loss_scale: StaticLossScale | DynamicLossScale = DynamicLossScale(
                device, dynamic_loss_args
            )
        else:
            if dynamic_loss_args is not None:
                raise ValueError(
                    f"dynamic_loss_args={dict(dynamic_loss_args)!r} has no effect with "
                    "dynamic_loss_scale=False; pass dynamic_loss_scale=True or drop the args"
                )
            self._loss_scale = StaticLossScale(static_loss_scale)

        groups = swap_in_masters(optimizer, verbose=verbose)
        self.optimizer = optimizer
        self.fp16_groups = groups.fp16
        self.fp32_from_fp16_groups = groups.masters
        self.fp32_from_fp32_groups = groups.fp32
        self.overflow = False
        self._grads_to_copy = False  # backward ran, master grads not updated yet
        self._master_grads_ready = False  # master grads updated (and unscaled) this iteration
        self._unscaled_since_step = False  # zero_grad() does not undo this one
        if verbose:
            logger.info("FP16Optimizer: %s loss scale", "dynamic" if self.dynamic else "static")

    @property
    def dynamic(self) -> bool:
        """True when a GradScaler picks the scale."""
        return self._loss_scale.dynamic

    @property
    def loss_scale(self) -> float:
        """The current loss scale; with a dynamic scale, reading it waits for the device."""
        return self._loss_scale.value

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._loss_scale.value = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (holding the masters), for LR schedules."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-param state, keyed by the masters."""
        return self.optimizer.state

    def _grads(self) -> list[torch.Tensor]:
        return [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]

    def backward(
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """Replace ``loss.backward()``: scale the loss (in fp32), backward, update master grads.

        For several losses in one iteration, pass ``update_master_grads=False`` to every call and
        call :meth:`update_master_grads` once at the end (or let :meth:`step` do it).

        Raises:
            RuntimeError: the master grads were already updated this iteration (they have been
                unscaled, so adding more scaled grads would mix scales).
        """
        if self._master_grads_ready:
            raise RuntimeError(
                "backward() was called after the master grads were updated in this iteration; "
                "for several losses pass update_master_grads=False to every backward() and call "
                "update_master_grads() once, or call step()/zero_grad() first"
            )
        if self.dynamic and self._unscaled_since_step:
            raise RuntimeError(
                "backward() after zero_grad() in an iteration whose grads were already unscaled: "
                "with a dynamic loss scale, GradScaler unscales an optimizer's grads once per "
                "step. Call step() first (it skips the step when the grads overflowed)"
            )
        self._loss_scale.scale_loss(loss).backward(retain_graph=retain_graph)
        self._grads_to_copy = True
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Copy the model's 16-bit grads into the fp32 masters' grads, then unscale all grads.

        Only needed after ``backward(..., update_master_grads=False)``.
        """
        if self._master_grads_ready:
            raise RuntimeError(
                "update_master_grads() was already called in this iteration; call step() or "
                "zero_grad() before the next backward()"
            )
        for model_params, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups, strict=True):
            model_grads_to_master_grads(model_params, masters)
        self._loss_scale.unscale_(self.optimizer, self._grads())
        self._unscaled_since_step = True
        self._grads_to_copy = False
        self._master_grads_ready = True

    def _ensure_master_grads(self) -> None:
        if self._grads_to_copy:
            self.update_master_grads()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the masters (unless the grads overflowed) and round them into the model.

        With a dynamic scale the skip decision is GradScaler's, agreed by all ranks; it reads the
        agreed flag on the host once (as torch's GradScaler.step does).

        With ``closure`` (static scale only), the closure must call this object's ``zero_grad``
        and ``backward(loss)`` and return the loss, as with a plain torch optimizer.

        Returns:
            the closure's loss, or None.

        Raises:
            ValueError: ``closure`` with a dynamic loss scale.
        """
        if closure is not None:
            return self._step_with_closure(closure)
        self._ensure_master_grads()
        applied = self._loss_scale.step(self.optimizer, None)
        self._after_step(applied)
        return None

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        first_call = True

        def model_closure() -> Any:
            nonlocal first_call
            if not first_call:
                # Optimizers like LBFGS re-evaluate at new points: the model must see them.
                self._masters_to_model()
            first_call = False
            return closure()

        loss = None

        def keep_loss() -> Any:
            nonlocal loss
            loss = model_closure()
            return loss

        self._loss_scale.step(self.optimizer, keep_loss)
        self._after_step(True)
        return loss

    def _after_step(self, applied: bool) -> None:
        if applied:
            self._masters_to_model()
        elif logger.isEnabledFor(logging.INFO):
            logger.info(
                "FP16Optimizer: inf/NaN in grads, step skipped; loss scale now %g", self.loss_scale
            )
        self.overflow = not applied
        self._unscaled_since_step = False
        self._grads_to_copy = False
        self._master_grads_ready = False

    def _masters_to_model(self) -> None:
        for model_params, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups, strict=True):
            master_params_to_model_params(model_params, masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the masters, the fp32 params and the model's 16-bit params."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for group in self.fp16_groups:
            for p in group:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()
        self._grads_to_copy = False
        self._master_grads_ready = False

    def clip_master_grads(self, max_norm: float, norm_type: float | str = 2.0) -> float:
        """Clip the fp32 grads by their total norm; return that norm, or -1 if it is inf/NaN.

        -1 means these grads overflowed (apex's signal); they are left as they are and a dynamic
        scale will skip the step. This reads the norm on the host (waits for the device). On a
        multi-rank job without DDP-averaged grads, a rank whose own grads are finite returns its
        norm even if another rank overflowed; the step is still skipped on every rank.
        """
        norm_type = float(norm_type)  # apex also takes the string "inf"
        self._ensure_master_grads()
        grads = self._grads()
        if not grads:
            return 0.0
        norms = torch._foreach_norm(grads, norm_type)
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
        if not bool(torch.isfinite(total)):
            return -1.0
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return float(total)

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]]:
        """The fp32 grads the optimizer will use, one list per param group, in group order."""
        self._ensure_master_grads()
        return [
            [None if p.grad is None else p.grad.detach() for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the loss scale (or scaler state) and the fp32 masters.

        The keys are listed in ``dscale.master_weights._state``. Tensors are references, as in
        torch's state dicts: copy (or save) before training on. Dynamic mode waits for the device.
        """
        return {
            "dscale_master_weights_version": _master_state.VERSION,
            "dynamic_loss_scale": self.dynamic,
            **self._loss_scale.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`; the model's 16-bit params are then set from the masters.

        The whole dict is checked before anything changes, so a rejected dict leaves this object
        as it was.
        """
        _master_state.check_state_dict(
            state_dict, dynamic=self.dynamic, masters=self.fp32_from_fp16_groups
        )
        previous_scale = self._loss_scale.state_dict()
        self._loss_scale.load_state_dict(state_dict)  # validates its part before changing
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        except BaseException:
            self._loss_scale.load_state_dict(previous_scale)
            raise
        with torch.no_grad():
            for masters, saved in zip(
                self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"], strict=True
            ):
                if masters:
                    torch._foreach_copy_(list(masters), [t.to(masters[0].device) for t in saved])
        self._masters_to_model()
        self._grads_to_copy = False
        self._master_grads_ready = False
