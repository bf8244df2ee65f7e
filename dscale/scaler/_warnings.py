"""Say once when loss scaling is not needed: training that never touches fp16.

bf16 has fp32's exponent range, so its gradients do not underflow the way fp16's do; pure fp32 needs
no scaling either. The check runs on the first scale() call of the process only: it reads the loss's
dtype, the autocast state, and walks the loss's autograd graph (bounded) for fp16 inputs.
"""

from __future__ import annotations

import warnings

import torch

_MAX_NODES = 20_000
_checked = False


def _graph_dtypes(loss: torch.Tensor) -> set[torch.dtype]:
    dtypes: set[torch.dtype] = set()
    seen: set[object] = set()
    stack = [loss.grad_fn]
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for meta in getattr(node, "_input_metadata", ()):
            dtype = getattr(meta, "dtype", None)
            if dtype is not None:
                dtypes.add(dtype)
        stack.extend(fn for fn, _ in node.next_functions)
    return dtypes


def _reason(loss: torch.Tensor) -> str | None:
    device_type = loss.device.type
    if loss.dtype is torch.bfloat16:
        return "the loss is bfloat16"
    if torch.is_autocast_enabled(device_type) and (
        torch.get_autocast_dtype(device_type) is torch.bfloat16
    ):
        return "autocast runs in bfloat16"
    if loss.grad_fn is None:
        return None
    dtypes = _graph_dtypes(loss)
    if torch.float16 in dtypes or not dtypes:
        return None
    if torch.bfloat16 in dtypes:
        return "the loss's autograd graph holds bfloat16 but no float16 tensors"
    return "the loss's autograd graph holds no float16 tensors (fp32 training)"


def warn_if_scaling_is_not_needed(loss: torch.Tensor) -> None:
    """Warn once per process when the first scaled loss shows no fp16 anywhere."""
    global _checked
    if _checked:
        return
    _checked = True
    reason = _reason(loss)
    if reason is not None:
        warnings.warn(
            f"dscale.GradScaler: {reason}; loss scaling is only needed for float16 training. "
            "It still works, but dscale.StepGuard is made for this: no scaling, and a step whose "
            "grads hold an inf/NaN on any rank (or, with spike_signals, whose loss spikes) is "
            "still skipped on every rank; GradScaler(enabled=False) turns everything off.",
            stacklevel=3,
        )
