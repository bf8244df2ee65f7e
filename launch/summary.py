"""The end-of-job summary: printed, and written to ``summary.json`` in the run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_summary(
    ranks: list[dict[str, Any]],
    *,
    run_dir: Path,
    what: dict[str, Any],
    world_size: int | None = None,
) -> dict[str, Any]:
    """Job-wide fields (from rank 0's view), then one record per rank with its ``result``.

    ``what`` names what ran (``entrypoint``, or ``script`` and ``script_args``). A script's
    ranks report nothing but their rank, so its ``world_size`` is given.
    """
    r0 = next(r for r in ranks if r["rank"] == 0)
    return {
        "run_dir": str(run_dir),
        **what,
        "world_size": world_size or len(ranks),
        "steps": r0.get("steps"),
        "resumed_from": r0.get("resumed_from"),
        "restarts": r0.get("attempt"),
        "result": r0.get("result"),
        "ranks": sorted(ranks, key=lambda r: int(r["rank"])),
    }


def write_summary(summary: dict[str, Any], run_dir: Path) -> Path:
    path = run_dir / "summary.json"
    # default=repr: a return value JSON cannot hold is kept as its repr, not lost.
    path.write_text(json.dumps(summary, indent=2, default=repr) + "\n")
    return path


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.5g}"
    return str(value)


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines; the JSON file has everything."""
    ran = summary.get("entrypoint") or f"script {summary.get('script')}"
    steps = summary["steps"]
    lines = [
        f"dscale job finished: {ran} on {summary['world_size']} rank(s)"
        + (f", {steps} steps" if steps is not None else "")
        + (f", resumed from step {summary['resumed_from']}" if summary["resumed_from"] else "")
    ]
    result = summary.get("result")
    if isinstance(result, dict) and result:
        shown = ", ".join(f"{k} {_value(v)}" for k, v in list(result.items())[:8])
        lines.append(f"  rank 0 returned: {shown}")
    elif result is not None:
        lines.append(f"  rank 0 returned: {_value(result)}"[:200])
    for r in summary["ranks"]:
        if "skipped_steps" not in r:
            continue
        skipped = r["skipped_steps"]
        shown = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        skips = f"{r['num_skipped']} skipped steps [{shown}]"
        spikes = r.get("num_spike_skipped")
        if spikes is not None:
            skips += f" ({spikes} of them spikes)"
        if r.get("loss_scaling", True):
            lines.append(f"  rank {r['rank']}: final scale {r['final_scale']:g}, {skips}")
        else:  # a StepGuard: its scale is fixed at 1, so there is no loss scale to report
            lines.append(f"  rank {r['rank']}: {skips}, no loss scaling (step guard)")
    lines.append(f"  summary: {summary['run_dir']}/summary.json")
    return "\n".join(lines)
