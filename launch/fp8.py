"""``trainer.precision=fp8``: the model's linears become torchao float8 ones before wrapping.

Through dscale.fp8's public call only; the scaler is the StepGuard every non-fp16 job gets.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def convert(model: nn.Module, fp8: dict[str, Any], device: torch.device) -> None:
    """Convert ``model`` in place as ``fp8.*`` says; log what was converted and left."""
    import dscale.fp8

    emulate = str(fp8.get("emulate", "auto")).lower()
    conversion = dscale.fp8.convert_to_float8(
        model,
        recipe=fp8.get("recipe", "tensorwise"),
        keep_high_precision=list(fp8.get("keep_high_precision", ["head"])),
        emulate=device.type != "cuda" if emulate == "auto" else emulate == "true",
    )
    logger.info(
        "fp8: %d float8 linears (%s recipe), left in high precision: %s",
        len(conversion.converted),
        conversion.recipe,
        dict(conversion.left) or "none",
    )
