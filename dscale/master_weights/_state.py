"""FP16Optimizer's state-dict format, and its validation before anything is loaded.

Keys:
    dscale_master_weights_version: format version (1).
    dynamic_loss_scale: whether the scale was dynamic; must match on load.
    loss_scale: the static scale (static mode only).
    scaler: dscale.GradScaler's state dict (dynamic mode only).
    optimizer: the wrapped optimizer's state dict (its params are the masters).
    fp32_from_fp16: the fp32 masters, one list per param group. The model's fp16 weights are the
        masters rounded, so they cannot restore them: without this key a resume is not exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

VERSION = 1


def check_state_dict(
    sd: Mapping[str, Any], *, dynamic: bool, masters: list[list[torch.nn.Parameter]]
) -> None:
    """Raise a ValueError if ``sd`` cannot be loaded into an FP16Optimizer with these masters."""
    needed = {"dscale_master_weights_version", "dynamic_loss_scale", "optimizer", "fp32_from_fp16"}
    needed.add("scaler" if dynamic else "loss_scale")
    missing = sorted(needed - set(sd))
    if missing:
        raise ValueError(
            f"state_dict is missing {missing}; pass a dict from FP16Optimizer.state_dict() "
            "(a plain optimizer state dict goes to .optimizer.load_state_dict)"
        )
    if sd["dscale_master_weights_version"] != VERSION:
        raise ValueError(
            "state_dict has dscale_master_weights_version="
            f"{sd['dscale_master_weights_version']!r}; this dscale reads {VERSION}"
        )
    if bool(sd["dynamic_loss_scale"]) != dynamic:
        raise ValueError(
            f"state_dict was saved with dynamic_loss_scale={sd['dynamic_loss_scale']!r} but "
            f"this FP16Optimizer has dynamic_loss_scale={dynamic}; build it the same way"
        )
    saved = [[tuple(t.shape) for t in group] for group in sd["fp32_from_fp16"]]
    ours = [[tuple(m.shape) for m in group] for group in masters]
    if saved != ours:
        raise ValueError(
            f"state_dict's fp32 masters have shapes {saved} (per param group) but this "
            f"FP16Optimizer's are {ours}; load a checkpoint of the same model and param groups"
        )
