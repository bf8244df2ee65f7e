"""Which float8 layers: names without wrappers, the ranks' layouts compared, name-keyed state.

Float8Numerics and Float8Fallback send and keep per-layer values in the order of the layers'
names, so every rank must measure the same layers (compared once, at construction, in one
collective) and a saved state must be for the same layers (matched by name when loaded).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dscale import _dist

#: Parts that wrappers insert anywhere in a name: torch.compile (of the model or of a block),
#: activation checkpointing, FSDP1. Reserved names: no model's own module is called so.
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


class LayoutMismatchError(ValueError):
    """Ranks converted different layers to float8 (raised on every rank, naming them)."""


def clean(name: str) -> str:
    """A module name without the wrappers' parts (``_orig_mod``, ``_checkpoint_wrapped_module``)."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside its outer wrappers: a module whose only child is ``module`` (DDP,
    DataParallel) or ``_orig_mod`` (torch.compile). A model's own ``module`` beside other
    children is the model's, and stays in the names."""
    while True:
        children = list(model.named_children())
        if len(children) != 1 or children[0][0] not in ("module", "_orig_mod"):
            return model
        model = children[0][1]


def named_layers(model: nn.Module, cls: type | tuple[type, ...]) -> list[tuple[str, Any]]:
    """``(name, module)`` of the ``cls`` modules, sorted, named as in the bare model.

    The same layer gets the same name wrapped or not (DDP, torch.compile of the model or of its
    blocks, activation checkpointing), so ranks and checkpoints compare by name across wrappers.
    """
    found: dict[str, Any] = {}
    for name, module in unwrapped(model).named_modules():
        if isinstance(module, cls):
            key = clean(name)
            if key in found:
                raise ValueError(
                    f"two float8 layers are both named {key!r} once wrappers' parts are "
                    f"dropped ({WRAPPER_PARTS}); rename one of them"
                )
            found[key] = module
    return sorted(found.items(), key=lambda item: item[0])


def state_int(value: Any) -> int:
    """An int from a state entry (a Python int or a one-element tensor); ValueError otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"expected an int (or a one-element int tensor) in the state, got {value!r}")


def check_layouts(
    layers: list[tuple[str, Any]], every: int, kinds: dict[str, str], group: Any
) -> None:
    """Compare what every rank measures (one collective); raise the same error on every rank.

    The values ride one MAX vector whose length and order follow the layers, so ranks that
    converted other layers would send vectors of other lengths (gloo: a reset connection on one
    rank, a hang on the other) or, with as many layers, each read the peers' rows under its own
    names; ranks sampling at other intervals would send on different steps.
    """
    mine = {
        "layers": [(n, m.in_features, m.out_features, kinds[n], _variant(m)) for n, m in layers],
        "every": every,
    }
    everyone = _dist.all_gather_objects(mine, group)
    recipes = [sorted({kind for _, _, _, kind, _ in r["layers"]}) for r in everyone]
    if any(kinds != recipes[0] for kinds in recipes):
        raise LayoutMismatchError(
            "Float8Numerics: ranks converted with different recipes ("
            + "; ".join(f"rank {r}: {'+'.join(k) or 'none'}" for r, k in enumerate(recipes))
            + "); every rank must train the same model: convert with the same recipe on "
            "every rank"
        )
    by_kind: dict[str, list[str]] = {}
    for r in everyone:
        for n, _, _, kind, _ in r["layers"]:
            if n not in by_kind.setdefault(kind, []):
                by_kind[kind].append(n)
    if len(by_kind) > 1:
        raise ValueError(
            "Float8Numerics measures one recipe per model; these layers scale differently: "
            + "; ".join(f"{kind}: {sorted(names)}" for kind, names in sorted(by_kind.items()))
            + ": convert every layer with one recipe (or measure one model per recipe)"
        )
    if any(r["layers"] != everyone[0]["layers"] for r in everyone):
        common = set.intersection(*(set(r["layers"]) for r in everyone))
        shapes = set.intersection(*({layer[:3] for layer in r["layers"]} for r in everyone))

        def shown(layer: tuple[Any, ...]) -> str:
            n, i, o, _, variant = layer  # the variant shown where only it differs
            return f"{n} ({i}->{o}, {variant})" if layer[:3] in shapes else f"{n} ({i}->{o})"

        detail = "; ".join(
            f"rank {r}: {len(v['layers'])} layers, only here: "
            f"{sorted(shown(layer) for layer in set(v['layers']) - common) or 'none'}"
            for r, v in enumerate(everyone)
        )
        raise LayoutMismatchError(
            f"Float8Numerics: ranks converted different layers to float8 ({detail}); the "
            "numerics of every rank ride one vector, layer by layer: convert the same layers on "
            "every rank (the same keep_high_precision, the same model)"
        )
    intervals = [r["every"] for r in everyone]
    if len(set(intervals)) > 1:
        raise ValueError(
            f"Float8Numerics: ranks sample at different intervals (every={intervals} by rank); "
            "every rank must sample the same steps: pass the same every on every rank"
        )


def _variant(module: Any) -> str:
    """How a float8 layer casts beyond its recipe's granularity (MXFP8: grad_weight in high
    precision, the scale rounding; torchao's float8: its config), compared across ranks."""
    if hasattr(module, "wgrad_with_hp"):
        mode = getattr(module, "scale_calculation_mode", None)
        return f"wgrad_with_hp={module.wgrad_with_hp}, {getattr(mode, 'name', mode)}"
    return module.extra_repr()  # type: ignore[no-any-return]  # torchao's: the cast configs


def refuse_other_layers(what: str, saved: list[str], count: int, names: list[str]) -> None:
    """ValueError naming the layers a state and this model do not share (any order is fine)."""
    missing = sorted(set(names) - set(saved))
    extra = sorted(set(saved) - set(names))
    if missing or extra or count != len(names):
        # Through a checkpoint, only this model's names are read back: the state's other
        # layers show as a count.
        unseen = count - len(saved) if count > len(saved) else 0
        raise ValueError(
            f"{what} state is for other float8 layers: {count} saved, this model has "
            f"{len(names)}; not in this model: {extra or 'none'}"
            + (f" (and {unseen} more not read back)" if unseen else "")
            + f"; not in the state: {missing or 'none'} (this model's float8 layers: {names}); "
            "load a checkpoint of the same model and conversion"
        )
