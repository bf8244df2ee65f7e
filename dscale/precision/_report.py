"""The shadow numerics in the run log and the report: a per-layer table and its proposed map.

``MetricsLog`` appends each sample of a ``ShadowNumerics`` on its scaler (host numbers already
read) to ``RUN_DIR/metrics/shadow-rank<R>.jsonl``: ``{"rank", "step", "dims", "measured",
"layers": snapshot()}``. ``python -m dscale.report RUN_DIR`` then writes ``RUN_DIR/shadow.md``:
per layer and operand, each format's worst saturated and flushed shares over every sample and
rank, and the map :func:`~dscale.precision.propose_precision_map` proposes from them with its
default thresholds (:func:`shadow_report`).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any

from dscale.precision._propose import PrecisionProposal, propose_precision_map
from dscale.precision._shadow import OPERANDS, shadow_of
from dscale.precision._shadow_stats import SHADOW_FORMATS


def log_shadow(log_dir: str, rank: int, scaler: Any, last: int | None) -> int | None:
    """Append the sample of the step just finished, if new; returns the step last written."""
    shadow = shadow_of(scaler)
    if shadow is None or not shadow.sampled_last_step or shadow.sample_step == last:
        return last
    rec = {
        "rank": rank,
        "step": shadow.sample_step,
        "dims": shadow.dims,
        "measured": sorted(shadow.measured),
        "layers": shadow.snapshot(),
    }
    with open(os.path.join(log_dir, f"shadow-rank{rank}.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    return int(shadow.sample_step)


def read_shadow_log(
    run_dir: str | os.PathLike[str],
) -> tuple[dict[str, dict[str, float]], dict[str, tuple[int, int]], set[str], int] | None:
    """``(table, dims, measured, samples)``: the worst of every logged sample and rank; None
    when the run logged no shadow numerics."""
    table: dict[str, dict[str, float]] = {}
    dims: dict[str, tuple[int, int]] = {}
    measured: set[str] = set()
    steps: set[int] = set()
    pattern = os.path.join(os.fspath(run_dir), "metrics", "shadow-rank*.jsonl")
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                steps.add(int(row["step"]))
                dims.update({k: (int(v[0]), int(v[1])) for k, v in row["dims"].items()})
                measured.update(row["measured"])
                for key, stats in row["layers"].items():
                    seen = table.setdefault(key, {})
                    for field, value in stats.items():
                        seen[field] = max(seen.get(field, value), value)
    return (table, dims, measured, len(steps)) if table else None


def shadow_table(
    table: Mapping[str, Mapping[str, float]], proposal: PrecisionProposal | None = None
) -> str:
    """A markdown table: a row per (layer, operand), per format ``saturated / flushed`` in %,
    and the proposed format on the layer's first row."""
    layers = sorted({key.split("/")[0] for key in table})
    head = (
        "| layer | operand | "
        + " | ".join(SHADOW_FORMATS)
        + (" | proposed |" if proposal else " |")
    )
    lines = [head, "|" + "---|" * (2 + len(SHADOW_FORMATS) + (1 if proposal else 0))]
    for layer in layers:
        for i, op in enumerate(OPERANDS):
            cells = []
            for fmt in SHADOW_FORMATS:
                row = table.get(f"{layer}/{op}/{fmt}", {})
                sat, flush = row.get("saturated", float("nan")), row.get("flushed", float("nan"))
                cells.append(f"{sat:.3%} / {flush:.3%}")
            extra = ""
            if proposal is not None:
                extra = f" {proposal.map.get(layer, '') if i == 0 else ''} |"
            lines.append(
                f"| {layer if i == 0 else ''} | {op} | " + " | ".join(cells) + " |" + extra
            )
    return "\n".join(lines)


def shadow_report(run_dir: str | os.PathLike[str]) -> str | None:
    """The report's shadow section (markdown), or None when the run logged none."""
    read = read_shadow_log(run_dir)
    if read is None:
        return None
    table, dims, measured, samples = read
    proposal = propose_precision_map(table, dims, unmeasured=[n for n in dims if n not in measured])
    reasons = "\n".join(f"- {n}: {r}" for n, r in sorted(proposal.reasons.items()))
    return (
        f"# Shadow numerics ({samples} samples, worst rank and sample)\n\n"
        "Per format: the share of elements saturated / flushed.\n\n"
        f"{shadow_table(table, proposal)}\n\n## Proposed precision map (default thresholds)\n\n"
        f"{reasons}\n"
    )
