"""WeightScales' state dict: the scales in use and the bound's state, keyed by layer name and shape.

Tensors only (``dscale.checkpoint`` stores them through DCP without pickling), one row per
float8 all-gather layer, in the order of ``names``:

- ``names``: the layers' names, UTF-8, one per line (uint8);
- ``shapes``: each weight's (whole, unsharded) shape, int64 ``[n, 2]``;
- ``scales``: the scales the next forward casts with, float32 ``[n]``;
- ``ratio_sq``: the bound's ``S`` per weight (``dscale.fp8._bound``), float64 ``[n]``;
- ``steps``: each weight's Adam step count that ``S`` holds at, float64 ``[n]``.

A state is matched to a model by name and shape, never by position: a model converted
differently (other layers, the same count) is refused with the layers named. The state saved
before names were kept (``scales`` and ``num_layers`` alone) is refused: it cannot be matched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

KEYS = ("names", "shapes", "scales", "ratio_sq", "steps")


class Rows(NamedTuple):
    """A checked state, in this model's layer order."""

    scales: torch.Tensor
    ratio_sq: torch.Tensor
    steps: torch.Tensor


def encode(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    scales: torch.Tensor,
    ratio_sq: torch.Tensor,
    steps: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The state dict (see the module docstring)."""
    return {
        "names": torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8),
        "shapes": torch.tensor([list(s) for s in shapes], dtype=torch.int64).reshape(-1, 2),
        "scales": scales.detach().clone().cpu(),
        "ratio_sq": ratio_sq.detach().clone().cpu().double(),
        "steps": steps.detach().clone().cpu().double(),
    }


def decode(state: Mapping[str, Any], names: Sequence[str], shapes: Sequence[Sequence[int]]) -> Rows:
    """``state``'s rows for this model's layers ``names`` (with ``shapes``); ValueError if the
    state is not of this model: other layers, other shapes, another format. Changes nothing."""
    fix = (
        "load a checkpoint of the same model converted the same way (the same "
        "keep_high_precision), or build WeightScales without loading this state: it then takes "
        "exact scales from the loaded weights (no saturation; not bit for bit the saved run)"
    )
    if "names" not in state and "scales" in state:
        raise ValueError(
            "WeightScales state from before layers were keyed by name (scales by position "
            f"only, {_count(state.get('scales'))} of them): it cannot be matched to this model's "
            f"layers {list(names)}; {fix}"
        )
    missing = [k for k in KEYS if not isinstance(state.get(k), torch.Tensor)]
    if missing:
        raise ValueError(f"WeightScales state lacks {missing} (tensors); {fix}")
    try:
        text = bytes(state["names"].reshape(-1).tolist()).decode("utf-8")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"WeightScales state: names are not UTF-8 text ({exc}); {fix}") from None
    saved = text.split("\n") if text else []
    n = len(saved)
    rows = {k: state[k] for k in KEYS[1:]}
    bad = [k for k, v in rows.items() if v.shape[:1] != (n,)]
    if bad or rows["shapes"].shape != (n, 2):
        raise ValueError(
            f"WeightScales state: {bad or ['shapes']} do not have one row per saved layer "
            f"({n}); {fix}"
        )
    if len(set(saved)) != n:
        raise ValueError(f"WeightScales state names a layer twice ({saved}); {fix}")
    here = list(names)
    only_there = [s for s in saved if s not in here]
    only_here = [s for s in here if s not in saved]
    if only_there or only_here:
        raise ValueError(
            "WeightScales state is of other float8 all-gather layers: in the state, not in "
            f"this model: {only_there}; in this model, not in the state: {only_here}; {fix}"
        )
    at = [saved.index(name) for name in here]
    saved_shapes = [tuple(rows["shapes"][i].tolist()) for i in at]
    wrong = [
        f"{name}: {tuple(there)} saved, {tuple(mine)} here"
        for name, there, mine in zip(here, saved_shapes, shapes)
        if tuple(there) != tuple(mine)
    ]
    if wrong:
        raise ValueError(f"WeightScales state has other weight shapes ({'; '.join(wrong)}); {fix}")
    index = torch.tensor(at, dtype=torch.long)
    scales = rows["scales"][index].float()
    if not bool((torch.isfinite(scales) & (scales > 0)).all()):
        raise ValueError(f"WeightScales state holds scales that are not finite and > 0; {fix}")
    return Rows(scales, rows["ratio_sq"][index].double(), rows["steps"][index].double())


def _count(scales: Any) -> Any:
    return scales.numel() if isinstance(scales, torch.Tensor) else scales
