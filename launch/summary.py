"""The end-of-job summary: printed, and written to ``summary.json`` in the run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_summary(ranks: list[dict[str, Any]], world_size: int, run_dir: Path) -> dict[str, Any]:
    """One record per rank plus job-wide loss and throughput (from rank 0's view)."""
    r0 = next(r for r in ranks if r["rank"] == 0)
    seconds = r0["seconds_this_attempt"]
    tokens = r0["tokens_this_attempt"]
    losses = r0["losses"]
    return {
        "run_dir": str(run_dir),
        "world_size": world_size,
        "steps": r0["steps"],
        "resumed_from": r0["resumed_from"],
        "restarts": r0["attempt"],
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "train_seconds": seconds,
        "ranks": [
            {
                "rank": r["rank"],
                "final_scale": r["final_scale"],
                "skipped_steps": r["skipped_steps"],
                "num_skipped": r["num_skipped"],  # also counts skips past the list's capacity
            }
            for r in sorted(ranks, key=lambda r: r["rank"])
        ],
    }


def write_summary(summary: dict[str, Any], run_dir: Path) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines; the JSON file has everything."""
    lines = [
        f"dscale job finished: {summary['steps']} steps on {summary['world_size']} rank(s)"
        + (f", resumed from step {summary['resumed_from']}" if summary["resumed_from"] else ""),
        f"  loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"{summary['tokens_per_s'] or 0:,.0f} tokens/s over {summary['train_seconds']:.1f} s"
        if summary["final_loss"] is not None
        else "  no steps run in the last attempt",
    ]
    for r in summary["ranks"]:
        skipped = r["skipped_steps"]
        shown = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        lines.append(
            f"  rank {r['rank']}: final scale {r['final_scale']:g}, "
            f"{len(skipped)} skipped steps [{shown}]"
        )
    lines.append(f"  summary: {summary['run_dir']}/summary.json")
    return "\n".join(lines)
