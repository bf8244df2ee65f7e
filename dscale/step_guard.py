"""dscale.StepGuard: the agreed skip of bad steps for bf16 and fp32 training, without scaling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dscale.scaler import GradScaler


class StepGuard(GradScaler):
    """Skip a step on every rank when any rank's grads hold an inf or NaN (or the loss spikes).

    For bf16 and fp32 training, which need no loss scale: the scale is fixed at 1, ``scale()``
    returns the loss as it is and ``unscale_()`` only checks. What is left of
    :class:`dscale.GradScaler` is the part that bf16 runs need too: each rank checks its own
    grads in one fused pass, one small all-reduce per step makes the decision common, and every
    rank skips the same steps, with the same counters, metrics and checkpoint state. The spike
    gate (``spike_signals``) adds OLMo-core's and Levanter's rule: skip a step whose loss or
    grad norm is far above the recent window. The loop is the loop of a GradScaler, so the same
    code serves fp16 (with a GradScaler) and bf16 (with a StepGuard).

    Example::

        guard = dscale.StepGuard("cuda", spike_signals=("loss", "grad_norm"))
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            guard.scale(loss).backward()  # the loss, unchanged
            guard.step(optimizer)  # skipped on every rank when one rank's grads are bad
            guard.update()

    Args:
        device: where its state lives ("cuda" or "cpu"), as GradScaler.
        enabled: False makes every method a pass-through.
        process_group, sync_free, stuck_patience: as GradScaler. A run of ``stuck_patience``
            skipped steps in a row is logged as a warning.
        spike_signals, spike_sigma, spike_window, spike_warmup: the spike gate, as GradScaler
            (off when ``spike_signals`` is empty, the default).

    State dict: GradScaler's keys with ``scale`` 1.0 and ``loss_scaling`` False (format version
    3), so a checkpoint says what saved it; the step counters and the spike window come along.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        enabled: bool = True,
        *,
        process_group: Any | None = None,
        sync_free: bool = False,
        stuck_patience: int = 100,
        spike_signals: Sequence[str] = (),
        spike_sigma: float = 6.0,
        spike_window: int = 128,
        spike_warmup: int = 64,
    ) -> None:
        super().__init__(
            device,
            init_scale=1.0,
            enabled=enabled,
            process_group=process_group,
            # The scale is pinned: it neither grows nor backs off, and the counters stay true.
            min_scale=1.0,
            max_scale=1.0,
            on_stuck_at_min="warn",
            stuck_patience=stuck_patience,
            sync_free=sync_free,
            spike_signals=spike_signals,
            spike_sigma=spike_sigma,
            spike_window=spike_window,
            spike_warmup=spike_warmup,
        )
        self._loss_scaling = False

    def __repr__(self) -> str:
        signals = "" if self._spike is None else f", spike_signals={self._spike.signals}"
        return f"StepGuard(device={self._device!r}, enabled={self._enabled}{signals})"
