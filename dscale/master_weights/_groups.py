"""Put fp32 masters into an optimizer's param groups in place of its 16-bit params."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


@dataclass
class MasterGroups:
    """Per param group: the model's 16-bit params, their fp32 masters, and the fp32 params."""

    fp16: list[list[torch.Tensor]]
    masters: list[list[torch.nn.Parameter]]
    fp32: list[list[torch.Tensor]]


def swap_in_masters(optimizer: torch.optim.Optimizer, *, verbose: bool) -> MasterGroups:
    """Replace every fp16/bf16 param of ``optimizer`` by an fp32 copy, keeping group order.

    Existing optimizer state moves to the masters (cast to fp32). Every param is checked before
    the optimizer is touched, so a TypeError leaves it as it was.

    Raises:
        TypeError: a param that is neither 16-bit nor fp32.
    """
    groups = MasterGroups([], [], [])
    new_params = []
    for index, group in enumerate(optimizer.param_groups):
        half, masters, fp32, params = _split(index, group["params"])
        groups.fp16.append(half)
        groups.masters.append(masters)
        groups.fp32.append(fp32)
        new_params.append(params)
        if verbose:
            logger.info(
                "FP16Optimizer: param group %d: %d 16-bit params get fp32 masters "
                "(%d elements), %d fp32 params are used as they are",
                index,
                len(half),
                sum(p.numel() for p in half),
                len(fp32),
            )
    for group, params in zip(optimizer.param_groups, new_params, strict=True):
        # In place: optimizers such as LBFGS keep a reference to this very list.
        group["params"][:] = params
    _move_state(optimizer.state, groups)
    return groups


_Split = tuple[list[torch.Tensor], list[torch.nn.Parameter], list[torch.Tensor], list[torch.Tensor]]


def _split(index: int, params: list[torch.Tensor]) -> _Split:
    half: list[torch.Tensor] = []
    masters: list[torch.nn.Parameter] = []
    fp32: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    for position, p in enumerate(params):
        if p.dtype in _HALF:
            master = torch.nn.Parameter(p.detach().clone().float())
            half.append(p)
            masters.append(master)
            out.append(master)
        elif p.dtype == torch.float32:
            fp32.append(p)
            out.append(p)
        else:
            raise TypeError(
                f"param {position} of param group {index} is {p.dtype}; FP16Optimizer takes "
                "fp16, bf16 (given fp32 masters) and fp32 params (used as they are)"
            )
    return half, masters, fp32, out


def _move_state(state: Any, groups: MasterGroups) -> None:
    for half, masters in zip(groups.fp16, groups.masters, strict=True):
        for p, master in zip(half, masters, strict=True):
            if p in state:
                state[master] = {
                    k: v.float() if k != "step" and _is_float_tensor(v) else v
                    for k, v in state.pop(p).items()
                }


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()
