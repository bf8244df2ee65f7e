"""Figures of ``python -m dscale.bench scaling``: per-run metrics, the table, the PNG."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

from dscale.bench._scaling_models import ZOO
from dscale.bench._scaling_runs import ArmRecord

FIRST_STEPS = 100  # "skipped in the first 100 steps"
WARMUP = 5  # steps left out of the cost comparison
FINAL_STEPS = 10  # the final loss is the mean of the last this many steps' losses
FAR_BELOW = 4.0  # "more than 4x below the largest safe scale"


def steps_to_within_2x(rec: ArmRecord) -> int | None:
    """The first probed step whose scale lies in [largest safe scale / 2, largest safe scale].

    None: never. A scale above the largest safe one overflows, so it does not count.
    """
    for step in sorted(rec.oracle):
        if rec.oracle[step] / 2.0 <= rec.scales[step] <= rec.oracle[step]:
            return step
    return None


def run_metrics(rec: ArmRecord, every: int) -> dict[str, Any]:
    """One arm of one run, reduced to the figures of the table.

    Averages over probes use the regular ones (every ``every`` steps from ``every`` on), a
    uniform sample of the run; step 0 is reported apart, because the predictive policy runs it
    at scale 1 on purpose. The dense probes of the first steps serve ``steps_to_within_2x``.
    """
    regular = [s for s in sorted(rec.oracle) if s % every == 0 and s > 0 and rec.oracle[s] > 0]
    below = [rec.oracle[s] / rec.scales[s] for s in regular]
    far = [b > FAR_BELOW for b in below]
    under = [rec.underflow[s] for s in regular if s in rec.underflow]
    return {
        "skipped_first_100": sum(rec.skipped[:FIRST_STEPS]),
        "skipped_total": sum(rec.skipped),
        "steps_to_within_2x": steps_to_within_2x(rec),
        "underflow_mean": statistics.fmean(under) if under else None,
        "underflow_step_0": rec.underflow.get(0),
        "final_loss": statistics.fmean(rec.losses[-FINAL_STEPS:]),
        "oracle_over_scale_median": statistics.median(below) if below else None,
        "far_below_share": statistics.fmean(far) if far else 0.0,
    }


def paired_cost(arm: ArmRecord, base: ArmRecord) -> list[float]:
    """Per-step time ratios ``arm / base`` over steps both applied, after the warm-up."""
    return [
        a / b
        for i, (a, b) in enumerate(zip(arm.seconds, base.seconds, strict=True))
        if i >= WARMUP and not arm.skipped[i] and not base.skipped[i] and b > 0
    ]


def median_interval(ratios: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Median and its 95% bootstrap interval (1000 resamples)."""
    if not ratios:
        return (math.nan, math.nan, math.nan)
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    return (statistics.median(ratios), meds[25], meds[974])


def summarize(runs: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """One row per (model, arm@init), over seeds. ``runs``: {model, seed, records}."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        records: dict[str, ArmRecord] = run["records"]
        for key, rec in records.items():
            row = rows.setdefault((run["model"], key), {"model": run["model"], "arm": key})
            row.setdefault("runs", []).append(run_metrics(rec, every))
            row.setdefault("per_seed", {})[run["seed"]] = row["runs"][-1]
            base = records["dynamic@" + key.split("@")[1]]
            row.setdefault("cost_ratios", []).extend(paired_cost(rec, base))
    out = []
    for row in rows.values():
        per_run = row.pop("runs")
        losses = [r["final_loss"] for r in per_run]
        reach = [r["steps_to_within_2x"] for r in per_run]
        under = [r["underflow_mean"] for r in per_run if r["underflow_mean"] is not None]
        first = [r["underflow_step_0"] for r in per_run if r["underflow_step_0"] is not None]
        below = [r["oracle_over_scale_median"] for r in per_run if r["oracle_over_scale_median"]]
        ratios = row.pop("cost_ratios")
        out.append(
            {
                **row,
                "seeds": len(per_run),
                "skipped_first_100_max": max(r["skipped_first_100"] for r in per_run),
                "skipped_total_mean": statistics.fmean(r["skipped_total"] for r in per_run),
                "steps_to_within_2x_max": None if None in reach else max(reach),  # type: ignore[type-var]
                "underflow_mean": statistics.fmean(under) if under else None,
                "underflow_step_0": statistics.fmean(first) if first else None,
                "oracle_over_scale_median": statistics.median(below) if below else None,
                "final_loss_mean": statistics.fmean(losses),
                "final_loss_sd": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "far_below_share_mean": statistics.fmean(r["far_below_share"] for r in per_run),
                "cost_vs_dynamic": median_interval(ratios),
            }
        )
    return out


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 25's targets, predictive against dynamic at the same init, seed by seed.

    On every model and seed: total skipped <= dynamic's; skipped in the first 100 steps <= 1;
    the share of probes more than 4x below the largest safe scale <= dynamic's; over the seeds,
    the final loss within seed noise (the difference of the means <= 2 sd of dynamic's, or
    1% of it); on the smooth models (where predictive was below it before the zoo), the
    underflow share <= dynamic's.
    """
    by_key = {(r["model"], r["arm"]): r for r in rows}
    out = []
    for (model, arm), row in by_key.items():
        if not arm.startswith("predictive@"):
            continue
        base = by_key[(model, "dynamic@" + arm.split("@")[1])]
        checks = []
        for seed, mine in row["per_seed"].items():
            theirs = base["per_seed"][seed]
            checks += [
                (f"seed {seed}: skipped total", mine["skipped_total"], theirs["skipped_total"]),
                (f"seed {seed}: skipped, first 100", mine["skipped_first_100"], 1),
                (
                    f"seed {seed}: share > 4x below",
                    mine["far_below_share"],
                    theirs["far_below_share"],
                ),
            ]
        noise = max(2.0 * base["final_loss_sd"], 0.01 * abs(base["final_loss_mean"]))
        checks.append(
            ("final loss - dynamic's", row["final_loss_mean"] - base["final_loss_mean"], noise)
        )
        smooth = model not in ZOO
        if smooth and base["underflow_mean"] is not None and row["underflow_mean"] is not None:
            checks.append(("underflow share", row["underflow_mean"], base["underflow_mean"]))
        for name, value, limit in checks:
            out.append(
                {
                    "model": model,
                    "arm": arm,
                    "target": name,
                    "value": value,
                    "limit": limit,
                    "ok": value <= limit + 1e-12,
                }
            )
    return out


def render_targets(results: list[dict[str, Any]]) -> str:
    """One line per target that failed, and a count of those met."""
    failed = [r for r in results if not r["ok"]]
    lines = [f"targets met: {len(results) - len(failed)} of {len(results)}"]
    for r in failed:
        lines.append(
            f"  MISSED {r['model']} {r['arm']} {r['target']}: {r['value']:g} > {r['limit']:g}"
        )
    return "\n".join(lines)


def render(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    """The Markdown table of docs/predictive.md."""
    head = (
        f"| model | scaler @ init | skipped, first {FIRST_STEPS} (max) | steps to within 2x "
        "(max) | skipped, total (mean) | largest safe / scale (median) | underflow share, "
        "step 0 | underflow share (mean) | final loss (mean +- sd) | probes > 4x below the "
        "largest safe scale (mean share) | step time / dynamic (median [95%]) |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        reach = r["steps_to_within_2x_max"]
        below = r["oracle_over_scale_median"]
        under = r["underflow_mean"]
        first = r["underflow_step_0"]
        med, lo, hi = r["cost_vs_dynamic"]
        cost = "1 (base)" if r["arm"].startswith("dynamic@") else f"{med:.3f} [{lo:.3f}, {hi:.3f}]"
        lines.append(
            f"| {r['model']} | {r['arm']} | {r['skipped_first_100_max']} | "
            f"{'never' if reach is None else reach} | {r['skipped_total_mean']:.1f} | "
            f"{'-' if below is None else f'{below:g}'} | "
            f"{'-' if first is None else f'{first:.4f}'} | "
            f"{'-' if under is None else f'{under:.4f}'} | "
            f"{r['final_loss_mean']:.4f} +- {r['final_loss_sd']:.4f} | "
            f"{r['far_below_share_mean']:.2f} | {cost} |"
        )
    lines.append(
        f"\n{cfg['steps']} steps per run of {', '.join(sorted({r['model'] for r in rows}))}, "
        f"{rows[0]['seeds'] if rows else 0} seeds; probes (largest safe "
        f"scale, underflow) on steps < {cfg['early']} and every {cfg['every']}th step; "
        f"medians and means over the probes of every {cfg['every']}th step from "
        f"{cfg['every']} on; '-': overflowed (skipped) at step 0."
    )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Scale (log2) and skipped steps over time, seed 0 of every model, one panel per init."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in runs if r["seed"] == runs[0]["seed"]]
    inits = sorted({k.split("@")[1] for k in first[0]["records"]}, key=lambda s: int(s[2:]))
    fig, axes = plt.subplots(
        len(first), len(inits), figsize=(6 * len(inits), 3.2 * len(first)), squeeze=False
    )
    # torch's line is drawn wide underneath: it coincides with dscale's dynamic one.
    styles = {
        "torch": ("tab:gray", 4.0),
        "dynamic": ("tab:blue", 1.5),
        "predictive": ("tab:red", 1.5),
    }
    for row, run in enumerate(first):
        for col, init in enumerate(inits):
            ax = axes[row][col]
            oracle_drawn = False
            for arm, (color, width) in styles.items():
                rec: ArmRecord = run["records"][f"{arm}@{init}"]
                steps = range(len(rec.scales))
                log2 = [math.log2(s) for s in rec.scales]
                ax.plot(steps, log2, "-", lw=width, alpha=0.8, color=color, label=arm)
                skips = [i for i, s in enumerate(rec.skipped) if s]
                if skips:
                    ax.plot(
                        skips,
                        [math.log2(rec.scales[i]) for i in skips],
                        "x",
                        color=color,
                        label=f"{arm}: skipped ({len(skips)})",
                    )
                if arm == "predictive" and not oracle_drawn:
                    xs = [s for s in sorted(rec.oracle) if rec.oracle[s] > 0]
                    ax.plot(
                        xs,
                        [math.log2(rec.oracle[s]) for s in xs],
                        "k.",
                        ms=4,
                        label="largest safe scale (predictive's run)",
                    )
                    oracle_drawn = True
            ax.set_title(f"{run['model']}, init scale {init}")
            ax.set_xlabel("step")
            ax.set_ylabel("log2 scale")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
