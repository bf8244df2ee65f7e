"""Render a run's metrics log to a PNG: ``python -m dscale.report RUN_DIR [--out FILE]``.

For people without Grafana: the scale sawtooth (log2 axis, skipped steps marked), the skipped steps,
and the grad norm, one line per rank, read from ``RUN_DIR/metrics/rank*.jsonl`` (``MetricsLog``).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def read_metrics_log(run_dir: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """Rows per rank from ``RUN_DIR/metrics/rank*.jsonl``, sorted by step."""
    pattern = os.path.join(os.fspath(run_dir), "metrics", "rank*.jsonl")
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise ValueError(
            f"run_dir={os.fspath(run_dir)!r} has no metrics log ({pattern}); attach "
            "dscale.metrics.MetricsLog(run_dir, ...) to the scaler to write one"
        )
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    by_rank.setdefault(int(row["rank"]), []).append(row)
    for rows in by_rank.values():
        rows.sort(key=lambda r: r["step"])
    return by_rank


def render(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> str:
    """Write the PNG and return its path (default ``RUN_DIR/metrics.png``)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    by_rank = read_metrics_log(run_dir)
    path = os.fspath(out) if out is not None else os.path.join(os.fspath(run_dir), "metrics.png")
    fig, (ax_scale, ax_skip, ax_norm) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for rank, rows in sorted(by_rank.items()):
        steps = [r["step"] for r in rows]
        ax_scale.step(steps, [r["scale"] for r in rows], where="post", label=f"rank {rank}")
        skipped = [r for r in rows if r["skipped"]]
        ax_scale.scatter(
            [r["step"] for r in skipped], [r["scale"] for r in skipped], marker="x", color="red"
        )
        cumulative, total = [], 0
        for r in rows:
            total += int(r["skipped"])
            cumulative.append(total)
        ax_skip.step(steps, cumulative, where="post", label=f"rank {rank}")
        norms = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
        if norms:
            ax_norm.plot(*zip(*norms, strict=True), label=f"rank {rank}")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale (x = skipped)")
    ax_skip.set_ylabel("skipped steps (cumulative)")
    ax_norm.set_ylabel("grad norm (unscaled)")
    if any(line.get_ydata().size for line in ax_norm.get_lines()):
        ax_norm.set_yscale("log")
    ax_norm.set_xlabel("optimizer step")
    for ax in (ax_scale, ax_skip, ax_norm):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"dscale run: {os.fspath(run_dir)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m dscale.report", description=__doc__)
    parser.add_argument("run_dir", help="directory holding metrics/rank*.jsonl")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = render(args.run_dir, args.out)
    except ValueError as exc:
        parser.error(str(exc))
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
