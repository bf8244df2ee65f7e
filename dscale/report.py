"""Render a run's metrics log to a PNG: ``python -m dscale.report RUN_DIR [--out FILE]``.

For people without Grafana: the loss (per step when the loop gave it to ``MetricsLog.note_loss``,
else at its log lines), the scale sawtooth (log2 axis), the skipped steps and the grad norm, one
line style per rank, skipped steps marked x and resumes marked by a dashed line, read from
``RUN_DIR/metrics/rank*.jsonl`` and ``loss-rank*.jsonl`` (``MetricsLog``). A StepGuard's run
(bf16, fp32, FP8: no loss scale) has no scale or skip-count panels: its loss and grad norm, the
skipped steps marked on both, and, with a spike gate, the band its rule allows (mean to mean +
sigma x std of the last ``window`` applied values). An FP8 run that sampled
``dscale.fp8.Float8Numerics`` (``fp8-rank*.jsonl``) gets per-layer heatmaps over the sampled
steps: the shares flushed to zero, subnormal and saturated, and the amax headroom, and the
recipe's own fields it logged (rowwise rows, MXFP8/NVFP4 blocks, scale spread, NVFP4 tensor
scale: dscale/fp8/_report.py) (``--fp8`` picks which).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
from collections import deque
from collections.abc import Sequence
from typing import Any

from dscale.fp8 import _report as _report_fp8

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


# The largest finite values of torchao's float8 formats: e4m3fn for inputs and weights, e5m2
# for the gradients of the outputs (torch.finfo(torch.float8_e4m3fn).max, ...e5m2).
_FP8_MAX = {"e4m3fn": 448.0, "e5m2": 57344.0}

#: The x axis: the log's 0-based optimizer steps, where the launcher prints steps from 1.
STEP_AXIS = "optimizer step (from 0: the launcher's step N is at N-1)"

#: The FP8 views ``python -m dscale.report --fp8`` can draw, each a heatmap of layer x step.
#: A run draws the recipe views only where it logged their field.
FP8_VIEWS = ("flushed", "subnormal", "saturated", "headroom", *_report_fp8.VIEWS)
_FP8_LABELS = {
    "flushed": "FP8 flushed\nto zero (share)",
    "subnormal": "FP8 subnormal\n(share)",
    "saturated": "FP8 saturated\n(share)",
    "headroom": "FP8 amax headroom\n(binades)",
    **{view: f"FP8 {label}" for view, label in _report_fp8.LABELS.items()},
}


def _fp8_value(key: str, stats: dict[str, float], view: str) -> float:
    """A share as logged, or the headroom: log2(format max / (amax x scale)), < 0 saturates."""
    if view != "headroom":
        return float(stats.get(view, math.nan))  # a recipe field this layer did not log: NaN
    if "tensor_scale" in stats:
        return math.nan  # NVFP4: no single scale puts amax at a format's max
    scaled = float(stats["amax"]) * float(stats["scale"])
    top = _FP8_MAX["e5m2" if key.endswith("/grad_output") else "e4m3fn"]
    if not (scaled > 0 and math.isfinite(scaled)):
        return math.nan
    # Rounded: dynamic scales put amax at the format's max, and 1e-16 of float noise around 0
    # would set the colour scale.
    return round(math.log2(top / scaled), 6) + 0.0


def read_fp8_log(
    run_dir: str | os.PathLike[str], share: str = "flushed"
) -> tuple[list[int], list[str], list[list[float]]] | None:
    """The FP8 numerics samples (``metrics/fp8-rank*.jsonl``) as ``(steps, keys, values)``.

    ``values[k][i]`` is ``share`` of ``keys[k]`` ("layer/tensor") at ``steps[i]``: one of
    :data:`FP8_VIEWS`, the worst over ranks (the largest share, the smallest headroom; ranks log
    the same agreed sample); None when the run logged no FP8 numerics.
    """
    if share not in FP8_VIEWS:
        raise ValueError(f"share={share!r} is not one of {', '.join(FP8_VIEWS)}")
    worst = min if share == "headroom" else max
    by_step: dict[int, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(run_dir), "metrics", "fp8-rank*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    seen = by_step.setdefault(int(row["step"]), {})
                    for key, stats in row["layers"].items():
                        value = _fp8_value(key, stats, share)
                        seen[key] = worst(seen[key], value) if key in seen else value
    if not by_step or all(math.isnan(v) for rows in by_step.values() for v in rows.values()):
        return None  # no sample, or a recipe field this run did not log
    steps = sorted(by_step)
    keys = sorted({k for rows in by_step.values() for k in rows})
    return steps, keys, [[by_step[s].get(k, math.nan) for s in steps] for k in keys]


def _fp8_heatmap(ax: Any, fp8: tuple[list[int], list[str], list[list[float]]], view: str) -> None:
    """One view per layer over the sampled steps (each column until the next sample)."""
    steps, keys, values = fp8
    width = steps[-1] - steps[-2] if len(steps) > 1 else 1
    edges = [*steps, steps[-1] + width]
    mesh = ax.pcolormesh(edges, range(len(keys) + 1), values, cmap="viridis", shading="flat")
    ax.set_yticks([i + 0.5 for i in range(len(keys))], keys, fontsize="x-small")
    ax.set_ylabel(_FP8_LABELS[view])
    ax.figure.colorbar(mesh, ax=ax, pad=0.01)


def is_step_guard_run(by_rank: dict[int, list[dict[str, Any]]]) -> bool:
    """Whether the log is a StepGuard's (no loss scale): rows marked so, or a scale fixed at 1."""
    rows = [r for rows in by_rank.values() for r in rows]
    if any(r.get("loss_scaling") is False for r in rows):
        return True
    return all(r["scale"] == 1.0 and not r["growths"] and not r["backoffs"] for r in rows)


def spike_settings(by_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The spike gate's signals, sigma, window and warmup as the log recorded them, or None."""
    for rows in by_rank.values():
        for r in rows:
            if "spike" in r:
                return dict(r["spike"])
    return None


def spike_band(
    rows: Sequence[dict[str, Any]], key: str, *, sigma: float, window: int, warmup: int
) -> list[tuple[int, float, float]]:
    """``(step, mean, mean + sigma x std)`` of the gate's rule over the logged ``key`` values.

    The rule of dscale's spike gate: the last ``window`` values of applied steps, once
    ``warmup`` of them (and at least 2) are in; the sample standard deviation. A step above the
    upper edge is skipped as a spike.
    """
    kept: deque[float] = deque()
    total = squares = 0.0
    band = []
    for r in rows:
        n = len(kept)
        if n >= max(warmup, 2):
            mean = total / n
            std = math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1))
            band.append((int(r["step"]), mean, mean + sigma * std))
        value = r.get(key)
        if not r["skipped"] and value is not None and math.isfinite(value):
            kept.append(value)
            total, squares = total + value, squares + value * value
            if len(kept) > window:
                old = kept.popleft()
                total, squares = total - old, squares - old * old
    return band


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


def render(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    fp8: Sequence[str] = FP8_VIEWS,
) -> str:
    """Write the PNG of :func:`figure` and return its path (default ``RUN_DIR/metrics.png``)."""
    fig = figure(run_dir, fp8=fp8)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    path = os.fspath(out) if out is not None else os.path.join(os.fspath(run_dir), "metrics.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mark_skips(ax: Any, rows: Sequence[dict[str, Any]], key: str, skipped: set[int]) -> None:
    marks = [r for r in rows if r["step"] in skipped and r.get(key) is not None]
    ax.scatter(
        [r["step"] for r in marks], [r[key] for r in marks], marker="x", color="red", zorder=20
    )


def figure(run_dir: str | os.PathLike[str], *, fp8: Sequence[str] = FP8_VIEWS) -> Any:
    """The report's matplotlib Figure.

    Panels: the loss (if logged), then under a loss scaler the scale (log2, x = skipped) and the
    cumulative skips, then the grad norm (x = skipped; a StepGuard's spike band); a line style per
    rank; an FP8 heatmap per view in ``fp8`` (:data:`FP8_VIEWS`); resumes dashed on every panel.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    unknown = [v for v in fp8 if v not in FP8_VIEWS]
    if unknown:
        raise ValueError(f"fp8 views {unknown} are not among {', '.join(FP8_VIEWS)}")
    by_rank = read_metrics_log(run_dir)
    guard = is_step_guard_run(by_rank)
    spike = spike_settings(by_rank) if guard else None
    # Per-step losses (MetricsLog.note_loss) when the run logged them, else the progress lines'.
    per_step = {
        rank: [{"step": r["step"], "loss": r["loss"]} for r in rows if r.get("loss") is not None]
        for rank, rows in by_rank.items()
    }
    losses = {r: rows for r, rows in per_step.items() if rows} or read_loss_log(run_dir)
    heatmaps = [(v, m) for v in fp8 if (m := read_fp8_log(run_dir, v)) is not None]
    names = (["loss"] if losses else []) + ([] if guard else ["scale", "skip"]) + ["norm"]
    rows_n = len(names) + len(heatmaps)
    fig, all_axes = plt.subplots(rows_n, 1, figsize=(10, 2.4 * rows_n + 1), sharex=True)
    all_axes = list(all_axes) if rows_n > 1 else [all_axes]
    panel = dict(zip(names, all_axes, strict=False))
    ax_loss, ax_norm = panel.get("loss"), panel["norm"]
    ax_scale, ax_skip = panel.get("scale"), panel.get("skip")
    for (view, data), ax in zip(heatmaps, all_axes[len(names) :], strict=True):
        _fp8_heatmap(ax, data, view)
    if heatmaps:
        all_axes[-1].set_xlabel(STEP_AXIS.replace(")", "; FP8 samples)"))
    ranks = sorted(set(by_rank) | set(losses))
    for i, rank in enumerate(ranks):
        style = _style(i, len(ranks))
        label = f"rank {rank}"
        rows = by_rank.get(rank, [])
        skipped_steps = {r["step"] for r in rows if r["skipped"]}
        if ax_loss is not None and rank in losses:
            lrows = losses[rank]
            ax_loss.plot(
                [r["step"] for r in lrows], [r["loss"] for r in lrows], label=label, **style
            )
            _mark_skips(ax_loss, lrows, "loss", skipped_steps)
            if spike and "loss" in spike["signals"] and i == 0:
                _draw_band(ax_loss, rows, "loss", spike)  # per-step losses, with skips
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        if ax_scale is not None and ax_skip is not None:
            ax_scale.step(steps, [r["scale"] for r in rows], where="post", label=label, **style)
            _mark_skips(ax_scale, rows, "scale", skipped_steps)
            cumulative, total = [], 0
            for r in rows:
                total += int(r["skipped"])
                cumulative.append(total)
            ax_skip.step(steps, cumulative, where="post", label=label, **style)
        norms = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
        if norms:
            ax_norm.plot(*zip(*norms, strict=True), label=label, **style)
            if guard:
                _mark_skips(ax_norm, rows, "grad_norm", skipped_steps)
            if spike and "grad_norm" in spike["signals"] and i == 0:
                _draw_band(ax_norm, rows, "grad_norm", spike)
    _dress_axes(
        panel,
        all_axes[: len(names)],
        all_axes,
        by_rank,
        guard=guard,
        heatmaps=bool(heatmaps),
        resumes=read_resumes(run_dir),
    )
    fig.suptitle(f"dscale run {os.fspath(run_dir)}\n{_headline(by_rank, spike)}", fontsize="medium")
    fig.tight_layout()
    return fig


def _dress_axes(
    panel: dict[str, Any],
    panels: Sequence[Any],
    all_axes: Sequence[Any],
    by_rank: dict[int, list[dict[str, Any]]],
    *,
    guard: bool,
    heatmaps: bool,
    resumes: Sequence[int],
) -> None:
    """Labels, scales, grids and legends of the panels, and a line where each resume took over."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax_loss, ax_norm = panel.get("loss"), panel["norm"]
    ax_scale, ax_skip = panel.get("scale"), panel.get("skip")
    if ax_loss is not None:
        ax_loss.set_ylabel("loss\n(x = skipped step)")
    if ax_scale is not None and ax_skip is not None:
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_ylabel("loss scale\n(x = skipped step)")
        ax_skip.set_ylabel("skipped steps\n(cumulative)")
        ax_skip.yaxis.set_major_locator(MaxNLocator(integer=True))
        most = max((sum(bool(r["skipped"]) for r in rows) for rows in by_rank.values()), default=0)
        ax_skip.set_ylim(-0.05 * max(most, 1), 1.1 * max(most, 1))  # 0 skips: a line at 0
    ax_norm.set_ylabel("grad norm\n(x = skipped step)" if guard else "grad norm\n(unscaled)")
    if any(line.get_ydata().size for line in ax_norm.get_lines()):
        ax_norm.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax_norm.yaxis.set_major_formatter(plain)
        ax_norm.yaxis.set_minor_formatter(plain)
    if not heatmaps:
        ax_norm.set_xlabel(STEP_AXIS)
    for ax in panels:
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(loc="best", fontsize="small")
    for step in resumes:  # where a later attempt took over from a checkpoint
        for ax in all_axes:
            ax.axvline(step, color="grey", linestyle="--", linewidth=1, zorder=1)
        all_axes[0].annotate(
            f"resumed at {step}",
            (step, 1),
            xycoords=("data", "axes fraction"),
            fontsize="small",
            xytext=(3, -12),
            textcoords="offset points",
            color="grey",
        )


def _draw_band(ax: Any, rows: Sequence[dict[str, Any]], key: str, spike: dict[str, Any]) -> None:
    """The spike gate's band on ``key``: from the window's mean up to the skip threshold."""
    band = spike_band(
        rows, key, sigma=spike["sigma"], window=spike["window"], warmup=spike["warmup"]
    )
    if not band:
        return
    steps, means, uppers = zip(*band, strict=True)
    ax.fill_between(
        steps,
        means,
        uppers,
        step="post",
        color="grey",
        alpha=0.2,
        zorder=1,
        label=f"spike band (mean + {spike['sigma']:g} sigma)",
    )


def _headline(by_rank: dict[int, list[dict[str, Any]]], spike: dict[str, Any] | None = None) -> str:
    """One line a bug report can quote: ranks, steps, skipped steps, first and last scale."""
    rows0 = by_rank[min(by_rank)]
    skipped = sum(bool(r["skipped"]) for r in rows0)
    head = (
        f"{len(by_rank)} rank(s), steps {rows0[0]['step']}..{rows0[-1]['step']}, {skipped} skipped"
    )
    if not is_step_guard_run(by_rank):
        return f"{head}, scale {rows0[0]['scale']:g} -> {rows0[-1]['scale']:g}"
    gate = (
        f", spike gate on {'/'.join(spike['signals'])} ({spike['sigma']:g} sigma, window "
        f"{spike['window']})"
        if spike
        else ""
    )
    return f"{head}, no loss scaling (step guard){gate}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m dscale.report", description=__doc__)
    parser.add_argument("run_dir", help="directory holding metrics/rank*.jsonl")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    parser.add_argument(
        "--fp8",
        default=",".join(FP8_VIEWS),
        help=f"FP8 heatmaps to draw, comma-separated from {','.join(FP8_VIEWS)} (default all; "
        "'' for none); only for runs that logged FP8 numerics",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        views = [v for v in args.fp8.split(",") if v]
        path = render(args.run_dir, args.out, fp8=views)
    except ValueError as exc:
        parser.error(str(exc))
    logger.info("wrote %s", path)
    from dscale.precision._report import shadow_report

    shadow = shadow_report(args.run_dir)  # a run that logged shadow numerics: their table
    if shadow is not None:
        table_path = os.path.join(args.run_dir, "shadow.md")
        with open(table_path, "w", encoding="utf-8") as f:
            f.write(shadow)
        logger.info("wrote %s", table_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
