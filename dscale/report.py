"""Render a run's metrics log to a PNG: ``python -m dscale.report RUN_DIR [--out FILE]``.

For people without Grafana: the loss (per step when the loop gave it to ``MetricsLog.note_loss``,
else at its log lines), the scale sawtooth (log2 axis), the skipped steps and the grad norm, one
line style per rank, skipped steps marked x and resumes marked by a dashed line, read from
``RUN_DIR/metrics/rank*.jsonl`` and ``loss-rank*.jsonl`` (``MetricsLog``); for an FP8 run that
sampled ``dscale.fp8.Float8Numerics`` (``fp8-rank*.jsonl``), a per-layer heatmap of the share
flushed to zero over the sampled steps.
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
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    # A resumed run's rows replace the steps it repeats.
                    by_rank.setdefault(int(row["rank"]), {})[int(row["step"])] = row
    return {rank: [rows[s] for s in sorted(rows)] for rank, rows in by_rank.items()}


def read_resumes(run_dir: str | os.PathLike[str]) -> list[int]:
    """The steps the run resumed at (rows marked ``"resumed": true`` by MetricsLog), sorted."""
    found = set()
    for path in glob.glob(os.path.join(os.fspath(run_dir), "metrics", "rank*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if '"resumed"' in line:
                    found.add(int(json.loads(line)["step"]))
    return sorted(found)


def read_loss_log(run_dir: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """Rows per rank from ``RUN_DIR/metrics/loss-rank*.jsonl`` (``MetricsLog.log_loss``), or {}."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(run_dir), "metrics", "loss-rank*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    by_rank.setdefault(int(row["rank"]), []).append(row)
    for rows in by_rank.values():
        rows.sort(key=lambda r: r["step"])
    return by_rank


def read_fp8_log(
    run_dir: str | os.PathLike[str], share: str = "flushed"
) -> tuple[list[int], list[str], list[list[float]]] | None:
    """The FP8 numerics samples (``metrics/fp8-rank*.jsonl``) as ``(steps, keys, values)``.

    ``values[k][i]`` is ``share`` of ``keys[k]`` ("layer/tensor") at ``steps[i]``, the largest
    over ranks (ranks log the same agreed sample); None when the run logged no FP8 numerics.
    """
    by_step: dict[int, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(run_dir), "metrics", "fp8-rank*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    seen = by_step.setdefault(int(row["step"]), {})
                    for key, stats in row["layers"].items():
                        seen[key] = max(seen.get(key, 0.0), float(stats[share]))
    if not by_step:
        return None
    steps = sorted(by_step)
    keys = sorted({k for rows in by_step.values() for k in rows})
    return steps, keys, [[by_step[s].get(k, 0.0) for s in steps] for k in keys]


def _fp8_heatmap(ax: Any, fp8: tuple[list[int], list[str], list[list[float]]]) -> None:
    """Per-layer flushed-to-zero share over the sampled steps (each column until the next)."""
    steps, keys, values = fp8
    width = steps[-1] - steps[-2] if len(steps) > 1 else 1
    edges = [*steps, steps[-1] + width]
    mesh = ax.pcolormesh(edges, range(len(keys) + 1), values, cmap="viridis", shading="flat")
    ax.set_yticks([i + 0.5 for i in range(len(keys))], keys, fontsize="x-small")
    ax.set_ylabel("FP8 flushed\nto zero (share)")
    ax.figure.colorbar(mesh, ax=ax, pad=0.01)


# Ranks usually agree on the scale, so their lines coincide: each rank gets its own colour and dash
# pattern, and a thinner line drawn over the one before it, so every rank stays visible.
_DASHES = ("-", "--", ":", "-.")


def _style(index: int, count: int) -> dict[str, Any]:
    return {
        "linestyle": _DASHES[index % len(_DASHES)],
        "linewidth": 1.0 + 1.5 * (count - 1 - index) / max(count - 1, 1),
        "zorder": 2 + index,
        "color": f"C{index % 10}",
    }


def render(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> str:
    """Write the PNG of :func:`figure` and return its path (default ``RUN_DIR/metrics.png``)."""
    fig = figure(run_dir)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    path = os.fspath(out) if out is not None else os.path.join(os.fspath(run_dir), "metrics.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(run_dir: str | os.PathLike[str]) -> Any:
    """The report's matplotlib Figure.

    Panels: the loss (when the run logged one with ``MetricsLog.log_loss``), the scale (log2 axis,
    x = skipped), the cumulative skipped steps and the grad norm; one line style per rank.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    by_rank = read_metrics_log(run_dir)
    # Per-step losses (MetricsLog.note_loss) when the run logged them, else the progress lines'.
    per_step = {
        rank: [{"step": r["step"], "loss": r["loss"]} for r in rows if r.get("loss") is not None]
        for rank, rows in by_rank.items()
    }
    losses = {r: rows for r, rows in per_step.items() if rows} or read_loss_log(run_dir)
    fp8 = read_fp8_log(run_dir)
    rows_n = (4 if losses else 3) + (1 if fp8 else 0)
    fig, all_axes = plt.subplots(rows_n, 1, figsize=(10, 2.4 * rows_n + 1), sharex=True)
    axes = all_axes[:-1] if fp8 else all_axes
    ax_loss = axes[0] if losses else None
    ax_scale, ax_skip, ax_norm = axes[-3:]
    if fp8:
        _fp8_heatmap(all_axes[-1], fp8)
        all_axes[-1].set_xlabel("optimizer step (FP8 samples)")
    ranks = sorted(set(by_rank) | set(losses))
    for i, rank in enumerate(ranks):
        style = _style(i, len(ranks))
        label = f"rank {rank}"
        if ax_loss is not None and rank in losses:
            rows = losses[rank]
            ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, **style)
            skipped_steps = {r["step"] for r in by_rank.get(rank, []) if r["skipped"]}
            marks = [r for r in rows if r["step"] in skipped_steps]
            ax_loss.scatter(
                [r["step"] for r in marks],
                [r["loss"] for r in marks],
                marker="x",
                color="red",
                zorder=20,
            )
        rows = by_rank.get(rank, [])
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        ax_scale.step(steps, [r["scale"] for r in rows], where="post", label=label, **style)
        skipped = [r for r in rows if r["skipped"]]
        ax_scale.scatter(
            [r["step"] for r in skipped],
            [r["scale"] for r in skipped],
            marker="x",
            color="red",
            zorder=20,
        )
        cumulative, total = [], 0
        for r in rows:
            total += int(r["skipped"])
            cumulative.append(total)
        ax_skip.step(steps, cumulative, where="post", label=label, **style)
        norms = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
        if norms:
            ax_norm.plot(*zip(*norms, strict=True), label=label, **style)
    _dress_axes(axes, ax_loss, by_rank, fp8=bool(fp8), resumes=read_resumes(run_dir))
    fig.suptitle(f"dscale run {os.fspath(run_dir)}\n{_headline(by_rank)}", fontsize="medium")
    fig.tight_layout()
    return fig


def _dress_axes(
    axes: Any,
    ax_loss: Any,
    by_rank: dict[int, list[dict[str, Any]]],
    *,
    fp8: bool,
    resumes: list[int],
) -> None:
    """Labels, scales, grids and legends of the panels, and a line where each resume took over."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax_scale, ax_skip, ax_norm = axes[-3:]
    if ax_loss is not None:
        ax_loss.set_ylabel("loss\n(x = skipped step)")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale\n(x = skipped step)")
    ax_skip.set_ylabel("skipped steps\n(cumulative)")
    ax_norm.set_ylabel("grad norm\n(unscaled)")
    ax_skip.yaxis.set_major_locator(MaxNLocator(integer=True))
    most = max((sum(bool(r["skipped"]) for r in rows) for rows in by_rank.values()), default=0)
    ax_skip.set_ylim(
        -0.05 * max(most, 1), 1.1 * max(most, 1)
    )  # 0 skips: a flat line at 0, not ±0.05
    if any(line.get_ydata().size for line in ax_norm.get_lines()):
        ax_norm.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax_norm.yaxis.set_major_formatter(plain)
        ax_norm.yaxis.set_minor_formatter(plain)
    if not fp8:
        ax_norm.set_xlabel("optimizer step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(loc="best", fontsize="small")
    for step in resumes:  # where a later attempt took over from a checkpoint
        for ax in axes:
            ax.axvline(step, color="grey", linestyle="--", linewidth=1, zorder=1)
        axes[0].annotate(
            f"resumed at {step}",
            (step, 1),
            xycoords=("data", "axes fraction"),
            fontsize="small",
            xytext=(3, -12),
            textcoords="offset points",
            color="grey",
        )


def _headline(by_rank: dict[int, list[dict[str, Any]]]) -> str:
    """One line a bug report can quote: ranks, steps, skipped steps, first and last scale."""
    rows0 = by_rank[min(by_rank)]
    skipped = sum(bool(r["skipped"]) for r in rows0)
    return (
        f"{len(by_rank)} rank(s), steps {rows0[0]['step']}..{rows0[-1]['step']}, "
        f"{skipped} skipped, scale {rows0[0]['scale']:g} -> {rows0[-1]['scale']:g}"
    )


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
