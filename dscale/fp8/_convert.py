"""convert_to_float8(): one call that swaps a model's linears for torchao's float8 ones.

dscale writes no FP8 kernels: the swap is torchao's ``convert_to_float8_training`` (tensorwise,
rowwise) or its ``MXFP8Linear`` (the MXFP8 recipes, :mod:`dscale.fp8._mx`). What this
adds is the choice made in one place (the recipe by name, a filter for layers kept in high
precision, linears whose dims the FP8 GEMM cannot take left as they are, with a log line naming
them) and a record of what was converted, which :class:`dscale.fp8.WeightScales` and the
telemetry read, and which ranks compare so that a rank that converted other layers fails loudly.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from dscale.fp8 import _mx, _nvfp4_prepare, _torchao

logger = logging.getLogger(__name__)

Recipe = Literal["tensorwise", "rowwise", "mxfp8", "mxfp8_wgrad_with_hp", "nvfp4"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "mxfp8", "mxfp8_wgrad_with_hp", "nvfp4")

#: torch._scaled_mm needs both GEMM dims of a weight divisible by 16 (cuBLASLt's rule for FP8).
DIM_MULTIPLE = 16


#: Where the converted layers' classes live: torchao's float8/MXFP8/NVFP4 linears and dscale's
#: MXFP8 one (:mod:`dscale.fp8._mx_linear`).
_CONVERTED = ("torchao.", "dscale.fp8.")


def dim_multiple(recipe: str) -> int:
    """What both dims of a weight must be divisible by under ``recipe`` (MXFP8: its block)."""
    if recipe == "nvfp4":
        return _nvfp4_prepare.DIM_MULTIPLE
    return _mx.BLOCK if recipe in _mx.WGRAD_WITH_HP else DIM_MULTIPLE


@dataclass(frozen=True)
class Float8Conversion:
    """What :func:`convert_to_float8` did: names of converted and left layers, and how.

    ``left`` maps a linear's name to why it stayed in high precision (``"filter"`` or the dims).
    """

    recipe: str
    float8_all_gather: bool
    converted: tuple[str, ...]
    left: dict[str, str] = field(default_factory=dict)

    def layout(self) -> tuple[str, bool, tuple[str, ...]]:
        """What every rank must agree on (compared across ranks by WeightScales)."""
        return (self.recipe, self.float8_all_gather, self.converted)


def convert_to_float8(
    model: nn.Module,
    *,
    recipe: Recipe = "tensorwise",
    keep_high_precision: Callable[[str, nn.Module], bool] | Iterable[str] | None = None,
    float8_all_gather: bool = False,
    emulate: bool = False,
) -> Float8Conversion:
    """Swap ``model``'s ``nn.Linear`` layers for torchao's float8 training linears, in place.

    Call it before wrapping the model in DDP or ``fully_shard`` (FSDP2), on every rank alike.
    E4M3 forward, E5M2 backward, dynamic scales (torchao's ``tensorwise`` or ``rowwise`` recipe);
    or MXFP8 (``mxfp8``: E4M3 elements with one E8M0 scale per 32, RCEIL rounding, in all three
    GEMMs; ``mxfp8_wgrad_with_hp``: grad_weight's GEMM in high precision), as torchao's
    ``MXFP8Linear``, which trains the bias too. A loss scaler composes unchanged: dynamic FP8
    scales cancel a power-of-two loss scale.

    Args:
        model: the model; changed in place (a root ``nn.Linear`` cannot be: wrap it).
        recipe: ``"tensorwise"`` (one scale per tensor; FSDP2 float8 all-gather possible) or
            ``"rowwise"`` (one scale per row; all-gathers in high precision), ``"mxfp8"`` or
            ``"mxfp8_wgrad_with_hp"`` (a scale per 32 elements; both dims of a weight must be
            divisible by 32, and in training the tokens per batch (all dims of the input but the
            last) too, unless grad_weight is in high precision: torchao's blocks), or
            ``"nvfp4"`` (torchao's ``NVFP4Linear``: E2M1 elements, an E4M3 scale per 16 and a
            per-tensor scale, random Hadamard transform, stochastic rounding in backward; dims
            divisible by 128; its training runs on torchao's Triton kernels only, so on a GPU;
            each layer's Hadamard signs are set from its name, alike on every rank, and its
            stochastic-rounding seed per rank, kept out of DDP's buffer broadcast: see
            :class:`dscale.fp8.NVFP4Seeds`).
        keep_high_precision: layers to leave as they are: a function ``(name, module) -> bool``
            or names as ``model.named_modules()`` gives them (a layer whose name equals or
            starts with ``name + "."`` is kept; each name must hold at least one
            ``nn.Linear``, any subclass counting; a block compiled alone may be named without
            its ``_orig_mod`` part, as Float8Numerics names it). Heads and the first/last
            layers are the usual choice.
        float8_all_gather: FSDP2 all-gathers the weights in float8 (tensorwise only); then use
            :class:`dscale.fp8.WeightScales` for the weights' scales.
        emulate: torchao's emulation (no ``torch._scaled_mm``), for hardware without FP8 (MXFP8:
            ``KernelPreference.EMULATED``; without it torchao's kernels, which need a GPU with
            MX support).

    Returns:
        A :class:`Float8Conversion` naming the converted layers and those left, with why.

    Raises:
        ImportError: torchao is missing (the message has the install line).
        ValueError: an unknown recipe, float8 all-gather with the rowwise recipe, or a name
            in ``keep_high_precision`` that matches no ``nn.Linear`` (the nearest are named).
    """
    _check_arguments(model, recipe, float8_all_gather, emulate)
    float8 = _torchao.float8()
    keep = _keep_function(keep_high_precision, model)
    aliases = _aliases(model)
    left = _left_in_high_precision(model, recipe, keep, aliases)
    if recipe in _mx.WGRAD_WITH_HP:
        names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n not in left]
        _mx.swap_linears(model, names, recipe=recipe, emulate=emulate)
        _share_swaps(model, aliases)
        return Float8Conversion(recipe, False, tuple(sorted(names)), left)
    if recipe == "nvfp4":
        names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n not in left]
        _nvfp4_prepare.swap_linears(model, names)
        _share_swaps(model, aliases)
        _nvfp4_prepare.prepare(model)
        return Float8Conversion(recipe, False, tuple(sorted(names)), left)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = _with(config, enable_fsdp_float8_all_gather=float8_all_gather, emulate=emulate)
    converted: list[str] = []

    def take(module: nn.Module, name: str) -> bool:
        if name in left or type(module) is not nn.Linear:
            return False
        converted.append(name)
        return True

    float8.convert_to_float8_training(model, module_filter_fn=take, config=config)
    _share_swaps(model, aliases)
    return Float8Conversion(recipe, float8_all_gather, tuple(sorted(converted)), left)


def _check_arguments(
    model: nn.Module, recipe: str, float8_all_gather: bool, emulate: bool = False
) -> None:
    """convert_to_float8()'s refusals before anything is swapped."""
    if recipe not in RECIPES:
        raise ValueError(
            f"recipe={recipe!r} is not one of {list(RECIPES)}; tensorwise keeps one scale per "
            "tensor (the default), rowwise one per row, mxfp8 one per 32 elements, nvfp4 one "
            "per 16 (and one per tensor)"
        )
    if float8_all_gather and recipe != "tensorwise":
        raise ValueError(
            f"float8_all_gather=True needs recipe='tensorwise', got recipe={recipe!r}: torchao's "
            "rowwise and MXFP8 recipes all-gather weights in high precision; pass "
            "float8_all_gather=False"
        )
    if recipe == "nvfp4" and emulate:
        raise ValueError(
            "recipe='nvfp4' has no emulation: torchao's NVFP4Linear trains on its Triton "
            "kernels only (a GPU with FP4 GEMMs); convert with emulate=False (the model is "
            "built on any device; its forward needs the GPU)"
        )
    if isinstance(model, nn.Linear):
        raise ValueError(
            "convert_to_float8() changes a model in place and cannot swap a root nn.Linear; "
            "wrap it (nn.Sequential(linear)) and convert that"
        )


def _left_in_high_precision(
    model: nn.Module,
    recipe: str,
    keep: Callable[[str, nn.Module], bool],
    aliases: dict[int, list[str]],
) -> dict[str, str]:
    """The linears the conversion leaves, by name, with why ("filter": kept by the caller);
    each one not kept by the caller is logged."""
    multiple = dim_multiple(recipe)
    left: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or type(module).__module__.startswith(_CONVERTED):
            continue  # not a linear, or converted already
        if any(keep(n, module) for n in aliases.get(id(module), [name])):
            left[name] = "filter"
        elif type(module) is not nn.Linear:
            left[name] = (
                f"a {type(module).__name__}, a subclass of nn.Linear (torchao swaps "
                "nn.Linear itself only)"
            )
        elif module.in_features % multiple or module.out_features % multiple:
            left[name] = (
                f"in_features={module.in_features}, out_features={module.out_features} "
                f"({recipe} GEMMs need both divisible by {multiple})"
            )
    for name, why in left.items():
        if why != "filter":
            logger.info("convert_to_float8: %s stays in high precision: %s", name, why)
    return left


def _references(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Per linear (by id): every ``(parent, attribute, name)`` that holds it."""
    found: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if isinstance(child, nn.Linear):
                name = f"{parent_name}.{attr}" if parent_name else attr
                found.setdefault(id(child), []).append((parent, attr, name))
    return found


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """The names of each linear the model holds in more than one place (a shared module),
    by id; ``named_modules()`` gives such a linear under its first name only."""
    return {
        key: [name for _, _, name in refs]
        for key, refs in _references(model).items()
        if len({name for _, _, name in refs}) > 1
    }


def _share_swaps(model: nn.Module, aliases: dict[int, list[str]]) -> None:
    """Point every other place that held a swapped shared linear at its swap.

    The swaps (torchao's and :func:`dscale.fp8._mx.swap_linears`) replace a module under the
    name ``named_modules()`` gives it, its first; the model's other references to the same
    module would keep the high-precision one, so that layer would run in float8 on one path
    and in high precision on the other, silently.
    """
    if not aliases:
        return
    refs = _references(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    for key, names in aliases.items():
        swapped = [modules[n] for n in names if n in modules and id(modules[n]) != key]
        if not swapped:
            continue  # left in high precision everywhere
        for parent, attr, _ in refs.get(key, []):
            setattr(parent, attr, swapped[0])


def _keep_function(
    keep: Callable[[str, nn.Module], bool] | Iterable[str] | None, model: nn.Module
) -> Callable[[str, nn.Module], bool]:
    if keep is None:
        return lambda name, module: False
    if callable(keep):
        return keep
    if isinstance(keep, str):
        raise ValueError(
            f"keep_high_precision={keep!r} is one string; pass a list of layer names "
            f"([{keep!r}]) or a function (name, module) -> bool"
        )
    # Here, not at the top: _layers imports _weight_scales, which imports this module.
    from dscale.fp8._layers import clean

    if not isinstance(keep, Iterable):
        raise ValueError(
            f"keep_high_precision={keep!r} is neither layer names nor a function; pass a list "
            "of names (as model.named_modules() gives them) or a function (name, module) -> "
            "bool (for a pattern: lambda name, module: bool(pattern.fullmatch(name)))"
        )
    names = tuple(keep)
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise ValueError(
            f"keep_high_precision holds {odd!r}, which are not layer names; pass names as "
            "strings (as model.named_modules() gives them) or a function (name, module) -> bool"
        )
    _refuse_names_keeping_nothing(names, model)
    return lambda name, module: any(_within(name, n) or _within(clean(name), n) for n in names)


def _within(name: str, kept: str) -> bool:
    """Whether module ``name`` is ``kept`` or inside it."""
    return name == kept or name.startswith(kept + ".")


def _refuse_names_keeping_nothing(names: tuple[str, ...], model: nn.Module) -> None:
    """ValueError naming each of ``names`` that keeps no ``nn.Linear``, with the nearest names.

    A mistyped name would otherwise keep nothing and convert the layer it meant, silently.
    """
    from dscale.fp8._layers import clean  # (see _keep_function)

    # Any linear counts (a subclass torchao leaves, as MultiheadAttention's out_proj, is kept
    # as asked), by its name or its name without wrappers' parts (a block compiled alone).
    found = [n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.Linear)]
    linears = sorted({*found, *map(clean, found)})
    unmatched = [n for n in names if not any(_within(linear, n) for linear in linears)]
    if not unmatched:
        return
    # Candidates: the linears and every module that holds one (a block kept whole).
    holders = sorted(
        {".".join(n.split(".")[:i]) for n in linears for i in range(1, n.count(".") + 2)}
    )
    kinds = dict(model.named_modules())
    parts = []
    for name in unmatched:
        near = difflib.get_close_matches(name, holders, n=3, cutoff=0.6)
        what = (
            f" (it names a {type(kinds[name]).__name__}, which holds no nn.Linear)"
            if name in kinds
            else ""
        )
        hint = f"nearest names {near}" if near else f"the model's linears: {linears[:8]}"
        parts.append(f"{name!r}{what}: {hint}")
    raise ValueError(
        "keep_high_precision names layers that match no nn.Linear of the model, so they would "
        "keep nothing and convert what they meant: "
        + "; ".join(parts)
        + ". Name a linear or a module that holds one, as model.named_modules() gives them"
    )


def _with(config: object, **changes: object) -> object:
    import dataclasses

    return dataclasses.replace(config, **changes)  # type: ignore[type-var]
