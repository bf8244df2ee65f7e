"""Whether a precision map (and its switches) is takeable on a model: checked, converting nothing.

Apart from the schedule because the launcher runs these checks before any worker starts, on a
model that no schedule will hold, and a rule about what torchao can run changes without the
schedule's state or agreement changing.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from torch import nn

from dscale.fp8._convert import _CONVERTED
from dscale.fp8._layers import unwrapped
from dscale.precision import _formats
from dscale.precision._formats import BF16, FLOAT8_LINEAR


def check_schedule(
    model: nn.Module,
    initial: Mapping[str, str],
    switches: Mapping[int, Mapping[str, str]] | None = None,
) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """``(initial, switches)`` checked against ``model``, converting nothing.

    What :class:`PrecisionSchedule` checks first (the launcher calls it before any worker
    starts): layer names are linears of the model, formats are :data:`FORMATS`, steps are
    positive ints and every switched layer has an initial format.

    Raises:
        ValueError: naming the bad layer (with the nearest names), format or step.
    """
    root = unwrapped(model)
    modules = scheduled_modules(root, initial)
    if any(isinstance(m, _fsdp2_module()) for m in root.modules()):
        raise ValueError(
            "PrecisionSchedule swaps modules, which fully_shard (FSDP2) has wrapped: build it "
            "on a plain or DDP model (FSDP2 is not supported)"
        )
    checked = {n: _formats.check_format(f, f"initial[{n!r}]") for n, f in initial.items()}
    planned = _checked_switches(switches or {}, modules)
    refuse_untakeable(root, modules, checked, "initial")
    for step, changes in planned.items():
        refuse_untakeable(root, modules, changes, f"switches[{step}]")
    return checked, planned


def refuse_untakeable(
    root: nn.Module, modules: Mapping[str, nn.Module], formats: Mapping[str, str], where: str
) -> None:
    """ValueError for a layer put in a format torchao cannot take it in (what
    ``convert_to_float8`` would leave): dims not divisible by the format's multiple (16 for
    torch._scaled_mm, MXFP8's 32-block), an ``nn.Linear`` subclass (its owner may not call its
    forward: MultiheadAttention's out_proj), or a linear held under several names (a swap
    replaces one)."""
    from dscale.fp8._convert import dim_multiple

    bad = []
    for name, fmt in formats.items():
        module = modules[name]
        if fmt == BF16 and (type(module) is nn.Linear or _torchao_linear(module)):
            continue
        others = [n for n, m in root.named_modules(remove_duplicate=False) if m is module]
        others.remove(name)
        multiple = dim_multiple("tensorwise" if fmt in FLOAT8_LINEAR else fmt)
        if type(module) is not nn.Linear and not _torchao_linear(module):
            bad.append(
                f"{name} is a {type(module).__name__}, a subclass of nn.Linear (torchao swaps "
                "nn.Linear itself only; its owner may not call its forward)"
            )
        elif others:
            bad.append(f"{name} is also held as {others} (a swap would replace one name only)")
        elif fmt != BF16 and (dims := _dims(module))[0] % multiple + dims[1] % multiple:
            bad.append(
                f"{name} has in_features={dims[0]}, out_features={dims[1]}; {fmt} needs both "
                f"divisible by {multiple}"
            )
    if bad:
        raise ValueError(
            f"PrecisionSchedule: {where} puts layers in formats torchao cannot run them in: "
            + "; ".join(bad)
            + ". Leave them out of the schedule (or in bf16)"
        )


def _dims(module: nn.Module) -> tuple[int, int]:
    return int(module.in_features), int(module.out_features)  # type: ignore[arg-type]


def _torchao_linear(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torchao.")


def _fsdp2_module() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def scheduled_modules(root: nn.Module, initial: Mapping[str, str]) -> dict[str, nn.Module]:
    """The layers ``initial`` names, each a linear of ``root``; ValueError naming bad names."""
    if not isinstance(initial, Mapping) or not initial:
        raise ValueError(f"initial must be a non-empty map layer name -> format, got {initial!r}")
    modules = dict(root.named_modules())
    linears = sorted(n for n, m in modules.items() if isinstance(m, nn.Linear))
    bad = []
    for name in initial:
        if name not in modules or not isinstance(modules[name], nn.Linear):
            near = difflib.get_close_matches(str(name), linears, n=3, cutoff=0.6)
            what = f"a {type(modules[name]).__name__}" if name in modules else "no module"
            bad.append(f"{name!r} ({what}; nearest linears {near or linears[:6]})")
    if bad:
        raise ValueError(
            "PrecisionSchedule: initial names layers that are not linears of the model: "
            + "; ".join(bad)
            + ". Name nn.Linear layers as model.named_modules() gives them"
        )
    found = {}
    for name in initial:
        module = modules[name]
        kind = type(module)
        if kind is not nn.Linear and not kind.__module__.startswith(_CONVERTED):
            raise ValueError(
                f"PrecisionSchedule: {name!r} (a {kind.__name__}, a subclass of nn.Linear) "
                "cannot be scheduled: a switch swaps the module for torchao's, which would drop "
                "the subclass's own forward (convert_to_float8 leaves it too); schedule "
                "nn.Linear layers only"
            )
        config = getattr(module, "config", None)
        if getattr(config, "enable_fsdp_float8_all_gather", False):
            raise ValueError(
                f"PrecisionSchedule: {name} is all-gathered in float8 (its weight arrives "
                "already cast, so it cannot switch); convert with float8_all_gather=False"
            )
        found[name] = module
    return found


def _checked_switches(
    switches: Mapping[int, Mapping[str, str]], modules: Mapping[str, nn.Module]
) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for step, changes in switches.items():
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(
                f"switches: step {step!r} must be a positive int (step 0's map is initial)"
            )
        unknown = sorted(set(changes) - set(modules))
        if unknown:
            raise ValueError(
                f"switches[{step}] names {unknown}, which initial does not; every switched "
                f"layer needs its format at step 0 in initial (it names {sorted(modules)})"
            )
        out[step] = {
            n: _formats.check_format(f, f"switches[{step}][{n!r}]") for n, f in changes.items()
        }
    return out
