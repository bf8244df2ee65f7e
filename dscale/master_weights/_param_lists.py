"""Apex-style manual master weights: fp32 copies of a model's params, and the copies both ways.

These are the three functions of ``apex.fp16_utils`` for users who write their own loop (see the
docs/master-weights.md). ``FP16Optimizer`` does the same bookkeeping for you.

The copies use foreach and flatten kernels, one launch per list rather than one per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["master_params_to_model_params", "model_grads_to_master_grads", "prep_param_lists"]


def prep_param_lists(
    model: torch.nn.Module, flat_master: bool = False
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Make fp32 master copies of ``model``'s trainable params.

    Give the masters to the optimizer; after each backward call
    :func:`model_grads_to_master_grads`, after each step :func:`master_params_to_model_params`.

    Args:
        model: the (usually ``.half()``) model.
        flat_master: put every master in one contiguous fp32 tensor (one optimizer tensor instead
            of many). Needs every trainable param in one dtype and on one device.

    Returns:
        ``(model_params, master_params)``; with ``flat_master`` the second list has one element,
        whose ``.grad`` buffer is allocated up front.

    Raises:
        ValueError: ``flat_master=True`` and the params differ in dtype or device.

    Example::

        model_params, master_params = prep_param_lists(model.half())
        optimizer = torch.optim.SGD(master_params, lr=0.1)
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    model_params = [p for _, p in named]
    if not flat_master:
        masters = [torch.nn.Parameter(p.detach().clone().float()) for p in model_params]
        return model_params, masters
    if not model_params:
        raise ValueError("prep_param_lists(flat_master=True) got a model with no trainable params")
    _check_one_kind(named)
    with torch.no_grad():
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
    master = torch.nn.Parameter(flat)
    master.grad = torch.zeros_like(flat)
    return model_params, [master]


def _check_one_kind(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise a ValueError naming the params that do not share the first param's dtype/device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, p in named:
        by_kind.setdefault((p.dtype, p.device), []).append(name)
    if len(by_kind) == 1:
        return
    main = max(by_kind, key=lambda k: len(by_kind[k]))
    odd = "; ".join(
        f"{dtype} on {device}: {', '.join(names)}"
        for (dtype, device), names in by_kind.items()
        if (dtype, device) != main
    )
    raise ValueError(
        f"flat_master=True needs every trainable param in one dtype on one device; most are "
        f"{main[0]} on {main[1]} ({len(by_kind[main])} params), but these differ: {odd}. "
        "Convert the model with model.half() first, pass flat_master=False, or use FP16Optimizer"
    )


def model_grads_to_master_grads(
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    flat_master: bool = False,
) -> None:
    """Copy the model's grads into the masters' ``.grad`` (converted to fp32).

    A model param without a grad leaves its master's grad ``None`` (non-flat) or zero (flat), so
    frozen or unused params are not updated by a stale grad.
    """
    if flat_master:
        (master,) = master_params
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        # cat(out=) converts fp16 -> fp32 while it writes: no fp16 flat buffer in between.
        torch.cat([g.detach().reshape(-1) for g in grads], out=master.grad.view(-1))
        return
    _check_lengths(model_params, master_params)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        dst.append(master.grad)
        src.append(model.grad.detach())
    if dst:
        torch._foreach_copy_(dst, src)


def master_params_to_model_params(
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    flat_master: bool = False,
) -> None:
    """Round the fp32 masters into the model's params (so the next forward sees the update)."""
    with torch.no_grad():
        if flat_master:
            (master,) = master_params
            sources = list(_unflatten_dense_tensors(master.detach(), list(model_params)))
        else:
            _check_lengths(model_params, master_params)
            sources = [m.detach() for m in master_params]
        if model_params:
            torch._foreach_copy_([p.detach() for p in model_params], sources)


def _check_lengths(model_params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> None:
    if len(model_params) != len(masters):
        raise ValueError(
            f"master_params has {len(masters)} tensors but model_params has {len(model_params)}; "
            "pass the two lists prep_param_lists returned (with flat_master as you gave it there)"
        )
