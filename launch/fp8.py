"""``trainer.precision=fp8``: torchao float8 linears, and what dscale.fp8 adds to them.

``convert`` swaps the model's linears before DDP/FSDP2 wrap it; ``build_parts`` then makes, from
``fp8.*``, the agreed FSDP2 float8 all-gather weight scales (``WeightScales``), the sampled
numerics (``Float8Numerics``, which the exporter serves and the metrics log records by itself),
the opt-in fallback (``Float8Fallback``) and, for NVFP4, ``NVFP4Seeds``, and returns them as
Statefuls for the job's checkpoints. Through dscale.fp8's public names only; the scaler is the
job's StepGuard.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Sampling interval of the numerics when ``fp8.numerics_every`` is unset (tensorwise recipe).
DEFAULT_NUMERICS_EVERY = 100


def convert(model: nn.Module, fp8: dict[str, Any], device: torch.device) -> Any:
    """Convert ``model`` in place as ``fp8.*`` says; log what was converted and left."""
    import dscale.fp8

    emulate = str(fp8.get("emulate", "auto")).lower()
    conversion = dscale.fp8.convert_to_float8(
        model,
        recipe=fp8.get("recipe", "tensorwise"),
        keep_high_precision=list(fp8.get("keep_high_precision", ["head"])),
        float8_all_gather=bool(fp8.get("float8_all_gather", False)),
        emulate=_emulate(emulate, fp8.get("recipe", "tensorwise"), device),
    )
    logger.info(
        "fp8: %d float8 linears (%s recipe%s), left in high precision: %s",
        len(conversion.converted),
        conversion.recipe,
        ", float8 all-gather" if conversion.float8_all_gather else "",
        dict(conversion.left) or "none",
    )
    return conversion


def _emulate(emulate: str, recipe: str, device: torch.device) -> bool:
    """``fp8.emulate`` resolved: auto emulates off CUDA, except NVFP4, which has no emulation."""
    if emulate != "auto":
        return emulate == "true"
    return device.type != "cuda" and recipe != "nvfp4"


def numerics_every(fp8: dict[str, Any]) -> int:
    """``fp8.numerics_every``, with None resolved (100 for tensorwise, 0 for the others)."""
    every = fp8.get("numerics_every")
    if every is None:
        return DEFAULT_NUMERICS_EVERY if fp8.get("recipe", "tensorwise") == "tensorwise" else 0
    return int(every)


def build_parts(
    model: nn.Module, optimizer: Any, scaler: Any, conversion: Any, fp8: dict[str, Any]
) -> dict[str, Any]:
    """The precision schedule, WeightScales, Float8Numerics and Float8Fallback as ``fp8.*``
    asks, by checkpoint key (the schedule first: the numerics measure the layers it leaves in
    float8).

    Every rank calls it (WeightScales compares the ranks' layouts in one collective).
    """
    import dscale.fp8

    parts: dict[str, Any] = {}
    schedule = fp8.get("schedule") or {}
    if schedule.get("initial"):
        import dscale.precision

        emulate = str(fp8.get("emulate", "auto")).lower()
        device = next(model.parameters()).device
        parts["precision_schedule"] = dscale.precision.PrecisionSchedule(
            model,
            scaler,
            initial=dict(schedule["initial"]),
            switches={int(k): dict(v) for k, v in (schedule.get("switches") or {}).items()},
            emulate=device.type != "cuda" if emulate == "auto" else emulate == "true",
            check_every=int(schedule.get("check_every", 16)),
        )
    if conversion.float8_all_gather:
        parts["fp8_weight_scales"] = dscale.fp8.WeightScales(
            model, optimizer, scaler, conversion, predict=str(fp8.get("predict", "bound"))
        )
    if conversion.recipe == "nvfp4":  # Hadamard signs checked at the first step; SR seeds saved
        parts["fp8_nvfp4"] = dscale.fp8.NVFP4Seeds(model, scaler)
    every = numerics_every(fp8)
    if every:
        numerics = dscale.fp8.Float8Numerics(model, scaler, every=every)
        parts["fp8_numerics"] = numerics
        if fp8.get("fallback"):
            parts["fp8_fallback"] = dscale.fp8.Float8Fallback(
                numerics,
                scaler,
                threshold=float(fp8.get("fallback_threshold", 0.01)),
                samples=int(fp8.get("fallback_samples", 3)),
            )
    logger.info(
        "fp8: %s",
        ", ".join(
            [
                f"weight scales agreed in the step's collective ({fp8.get('predict', 'bound')})"
                if "fp8_weight_scales" in parts
                else "weight scales torchao's dynamic ones",
                f"numerics every {every} steps" if every else "no numerics",
                "fallback on" if "fp8_fallback" in parts else "no fallback",
            ]
        ),
    )
    return parts
