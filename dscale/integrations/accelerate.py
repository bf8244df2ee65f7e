"""dscale in Hugging Face accelerate (and so in the HF Trainer): one call before prepare().

Example::

    accelerator = Accelerator(mixed_precision="fp16")  # cpu=True works too
    use_dscale(accelerator, dscale.GradScaler(accelerator.device.type))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

What it changes in the ``Accelerator`` (accelerate 1.15; the places are in its ``accelerator.py``):

- ``scaler`` becomes the dscale scaler and ``native_amp`` is set, so ``prepare()`` wraps the forward
  in fp16 autocast (accelerate leaves fp16 off on CPU, silently), ``backward()`` scales, and
  ``clip_grad_norm_`` unscales first.
- Optimizers from ``prepare()`` report ``step_was_skipped`` from dscale's agreed decision.
  accelerate infers it from whether ``optimizer.step`` ran, which fused optimizers and
  ``sync_free`` do on skipped steps too (on the device, with the update masked), so the LR
  scheduler, and the HF Trainer's, advanced on skipped steps. Reading it after a fused or
  sync-free step waits for the GPU once.
- ``save_state`` / ``load_state`` then write and read dscale's state dict (``scaler.pt``), also
  under FSDP2 (accelerate calls the scaler's ``_lazy_init_scale_growth_tracker`` there).
- A step with no ``accelerator.backward()`` since the optimizer's last step runs without the
  scaler. Under FSDP2, torch.distributed.checkpoint gives an optimizer with no state a zero-grad
  ``step()`` to create it (``load_state``, the HF Trainer's resume); through the scaler that step
  counted as a training step, so the scaler restored by ``load_state`` came back one step on
  (torch's scaler: its growth tracker; the HF Trainer's resume raises, no ``scale()`` yet).
"""

from __future__ import annotations

from typing import Any

from dscale.integrations._support import check_scaler, require_version, say_once
from dscale.scaler import GradScaler

__all__ = ["SUPPORTED", "DScaleAcceleratedOptimizer", "use_dscale"]

SUPPORTED = ("1.15", "1.16")  # accelerate >=1.15,<1.16: what the tests ran on
require_version("accelerate", *SUPPORTED, extra="accelerate")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402


def use_dscale(accelerator: Any, scaler: GradScaler) -> None:
    """Make ``accelerator`` scale fp16 losses with ``scaler``; call it before ``prepare()``.

    A disabled scaler, or an Accelerator whose ``mixed_precision`` is not "fp16" (bf16 needs no
    scaler), is said once and left as it is.

    Raises:
        RuntimeError: unsupported accelerate version (the message names the range).
        TypeError: ``scaler`` is not a ``dscale.GradScaler``.
        ValueError: called after ``prepare()``, DeepSpeed or Megatron-LM (they scale
            themselves), or a scaler on another device type than the Accelerator.
    """
    require_version("accelerate", *SUPPORTED, extra="accelerate")
    where = "dscale.integrations.accelerate.use_dscale"
    if not check_scaler(scaler, where):
        return
    if accelerator.mixed_precision != "fp16":
        say_once(
            f"{where}: the Accelerator runs mixed_precision={accelerator.mixed_precision!r}, which "
            "uses no loss scaler; left as it is. Pass Accelerator(mixed_precision='fp16') to scale"
        )
        return
    if accelerator._optimizers or accelerator._models:
        raise ValueError(
            f"{where}() was called after accelerator.prepare(): the prepared optimizers already "
            "hold accelerate's scaler. Call use_dscale(accelerator, scaler) right after building "
            "the Accelerator (for the HF Trainer: before trainer.train())"
        )
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"{where}: distributed_type={accelerator.distributed_type.value} scales the loss in "
            "its own engine; configure its fp16 loss scaling there instead"
        )
    device_type = accelerator.device.type
    if scaler._device != device_type:
        raise ValueError(
            f"{where}: scaler device={scaler._device!r} but the Accelerator runs on "
            f"{device_type!r}; build it as dscale.GradScaler({device_type!r}, ...)"
        )
    accelerator.scaler = scaler
    accelerator.native_amp = True  # fp16 autocast in prepare(), unscale before clipping
    _report_skips_from(accelerator)


def _report_skips_from(accelerator: Any) -> None:
    """Make the optimizers ``prepare()`` returns answer ``step_was_skipped`` from dscale."""
    original = accelerator.prepare_optimizer

    def prepare_optimizer(optimizer: Any, device_placement: Any = None) -> Any:
        prepared = original(optimizer, device_placement=device_placement)
        if isinstance(prepared, AcceleratedOptimizer) and not isinstance(
            prepared, DScaleAcceleratedOptimizer
        ):
            prepared.__class__ = DScaleAcceleratedOptimizer
            prepared._scale_calls_at_step = accelerator.scaler._scale_calls
        return prepared

    # prepare() looks the method up on the instance, so this covers prepare() and FSDP2 alike.
    accelerator.prepare_optimizer = prepare_optimizer


class DScaleAcceleratedOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """An AcceleratedOptimizer whose ``step_was_skipped`` is dscale's agreed decision."""

    def step(self, closure: Any = None) -> None:
        self._dscale_stepped = False
        scaler = self.scaler
        if self._grads_unscaled(scaler):
            self.optimizer.step(closure)  # e.g. DCP's state-creating zero-grad step
            return
        super().step(closure)
        self._dscale_stepped = (
            scaler is not None and scaler.is_enabled() and self.gradient_state.sync_gradients
        )
        if self._dscale_stepped:
            self._scale_calls_at_step = scaler._scale_calls

    def _grads_unscaled(self, scaler: GradScaler | None) -> bool:
        """No scale() (so no ``accelerator.backward()``) since this optimizer's last step."""
        if scaler is None or not scaler.is_enabled() or not self.gradient_state.sync_gradients:
            return False
        return scaler._scale_calls == getattr(self, "_scale_calls_at_step", None)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for inf/NaN grads, on every rank alike."""
        if getattr(self, "_dscale_stepped", False):
            return not self.scaler.step_applied(self.optimizer)
        return bool(self._is_overflow)
