"""propose_precision_map: a precision map from a shadow-numerics table (layer -> format name).

The rule (a data-driven form of "keep the last 15% of blocks in bf16"): each layer gets the first
format of ``formats`` (cheapest first) that

1. its weight's dims allow (both ``in_features`` and ``out_features`` divisible by the format's
   multiple, ``dscale.fp8._convert.dim_multiple``: 16 for tensorwise and rowwise, 32 for
   MXFP8, 128 for NVFP4, as ``convert_to_float8`` and torchao require), and
2. on every operand (input, weight, grad_output), over the whole sampled window, saturates at
   most ``max_saturated`` and flushes at most ``max_flushed`` of the elements (a NaN share
   passes no threshold);

and ``bf16`` when none does, with the reason; a layer never measured (its module's forward did
not run in a sample) stays ``bf16`` too. Every layer gets a reason naming what decided it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from dscale.fp8._convert import dim_multiple
from dscale.precision._formats import BF16, MXFP8, ROWWISE, TENSORWISE
from dscale.precision._shadow_stats import FIELDS, SHADOW_FORMATS

#: The default candidates, cheapest first: what convert_to_float8 takes on this dscale (NVFP4
#: is opt-in: ``formats=("nvfp4", "mxfp8", ...)``).
DEFAULT_FORMATS = (MXFP8, ROWWISE, TENSORWISE)
#: Default thresholds on the share of an operand's elements (any operand, any sample).
MAX_FLUSHED = 0.01
MAX_SATURATED = 0.001
OPERANDS = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class PrecisionProposal:
    """A proposed precision map and why: ``map`` (layer -> format name, ``bf16`` for none),
    ``reasons`` (layer -> one line)."""

    map: dict[str, str]
    reasons: dict[str, str]

    def kept_high_precision(self) -> list[str]:
        """The layers proposed to stay in bf16, sorted."""
        return sorted(n for n, f in self.map.items() if f == BF16)


def propose_precision_map(
    table: Mapping[str, Mapping[str, float]],
    dims: Mapping[str, tuple[int, int]],
    *,
    formats: Iterable[str] = DEFAULT_FORMATS,
    max_flushed: float = MAX_FLUSHED,
    max_saturated: float = MAX_SATURATED,
    unmeasured: Iterable[str] = (),
    left: Mapping[str, str] | None = None,
) -> PrecisionProposal:
    """Propose a format per layer from ``table`` (``ShadowNumerics.window()``: keys
    ``"layer/operand/format"``, values ``{saturated, flushed}``) and ``dims`` (layer ->
    ``(in_features, out_features)``, ``ShadowNumerics.dims``). See the module's rule.
    ``unmeasured``: layers whose forward never ran in a sample (their rows are zeros, not
    measurements): they stay bf16, with that reason. ``left``: layer -> why no format can take
    it (an ``nn.Linear`` subclass torchao leaves): bf16, with that reason."""
    formats = tuple(formats)
    bad = [f for f in formats if f not in SHADOW_FORMATS]
    if bad or not formats:
        raise ValueError(
            f"formats must name some of {SHADOW_FORMATS} (cheapest first), got {formats}"
        )
    for name, value in (("max_flushed", max_flushed), ("max_saturated", max_saturated)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} is a share of elements in [0, 1], got {value!r}")
    if not table:
        raise ValueError(
            "the table is empty: no sample was taken yet; propose after a sampled step "
            "(ShadowNumerics.num_samples > 0)"
        )
    chosen: dict[str, str] = {}
    reasons: dict[str, str] = {}
    limits = {"saturated": max_saturated, "flushed": max_flushed}
    skipped = set(unmeasured)
    for layer in sorted(dims):
        if layer in skipped:
            chosen[layer] = BF16
            reasons[layer] = "bf16: not measured (its forward never ran in a sampled step)"
            continue
        if left and layer in left:
            chosen[layer] = BF16
            reasons[layer] = f"bf16: {left[layer]}"
            continue
        in_f, out_f = dims[layer]
        refused: list[str] = []
        for fmt in formats:
            multiple = dim_multiple(fmt)
            if in_f % multiple or out_f % multiple:
                refused.append(f"{fmt}: dims {in_f}x{out_f} not divisible by {multiple}")
                continue
            worst = _worst(table, layer, fmt)
            over = [
                f"{op} {field} {value:.3g} > {limits[field]:g}"
                for (op, field), value in sorted(worst.items())
                if not value <= limits[field]  # a NaN share is not within a threshold
            ]
            if over:
                refused.append(f"{fmt}: {', '.join(over)}")
                continue
            chosen[layer] = fmt
            top = max(worst.values(), default=0.0)
            reasons[layer] = f"{fmt}: worst share {top:.3g} within the thresholds" + (
                f" ({'; '.join(refused)})" if refused else ""
            )
            break
        else:
            chosen[layer] = BF16
            reasons[layer] = "bf16: " + "; ".join(refused)
    return PrecisionProposal(chosen, reasons)


def _worst(
    table: Mapping[str, Mapping[str, float]], layer: str, fmt: str
) -> dict[tuple[str, str], float]:
    """Per (operand, field), the table's value for ``layer`` under ``fmt`` (KeyError if absent)."""
    out = {}
    for op in OPERANDS:
        key = f"{layer}/{op}/{fmt}"
        if key not in table:
            raise ValueError(
                f"the table has no {key!r}: pass ShadowNumerics.window() and the same "
                "ShadowNumerics.dims"
            )
        for field in FIELDS:
            out[(op, field)] = float(table[key][field])
    return out
