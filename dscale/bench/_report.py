"""Plain-text tables from the benchmark's result dict (the same dict ``--json`` writes)."""

from __future__ import annotations

import math
from typing import Any

from dscale.bench._stats import LEVEL, METHOD, noise

_MARK = {"lower": "<", "higher": ">", "no difference": "=", "n/a": "?"}
LEGEND = (
    f"ratios: {METHOD}; '<' lower and '>' higher (the interval excludes 1), "
    "'=' no difference (it holds 1), '?' undefined (an overhead at or below the noise)"
)


def _us(value: float) -> str:
    return f"{value:9.1f}"


def _interval(r: dict[str, Any] | None) -> str:
    if r is None:
        return f"{'-':>21}"
    est, low, high = (float(r[k]) for k in ("estimate", "low", "high"))
    if math.isnan(est):
        return f"{'n/a':>19} ?"
    bounds = "[  n/a     ]" if math.isnan(low) else f"[{low:4.2f}, {high:4.2f}]"
    return f"{est:5.2f} {bounds:>13} {_MARK[str(r['verdict'])]}"


def _aa_key(pairs: list[str]) -> str | None:
    return next((p for p in pairs if p.split("/")[0].endswith("_aa")), None)


def _noise_line(rows: list[tuple[str, dict[str, Any]]], ratio_key: str) -> str:
    """The section's noise, judged on its widest A/A interval."""
    aa_key = _aa_key(list(rows[0][1][ratio_key])) if rows else None
    if aa_key is None:
        return "noise: no A/A arm in this table"

    def width(r: dict[str, Any]) -> float:
        w = float(r["high"]) - float(r["low"])
        return math.inf if math.isnan(w) else w

    widest = max((ratios[ratio_key][aa_key] for _, ratios in rows), key=width)
    return f"noise ({aa_key} is A/A, widest of the table): {noise(widest)}"


def step_table(
    rows: list[tuple[str, dict[str, Any]]],
    ratio_key: str = "ratios",
    arms_key: str = "arms",
) -> str:
    """Per scenario: plain step and each arm's overhead (us, median), then each ratio's interval.

    ``rows`` pairs a label with a scenario dict holding ``arms_key`` (summaries by arm) and
    ``ratio_key`` (intervals by ``"num/den"``).
    """
    names = [n for n in rows[0][1][arms_key] if n != "plain"]
    pairs = list(rows[0][1][ratio_key])
    lines = [f"{'scenario':<32} {'plain us':>9} " + " ".join(f"{n + ' +us':>12}" for n in names)]
    for label, scenario in rows:
        arms = scenario[arms_key]
        cells = " ".join(f"{_us(arms[n]['overhead_median_us']):>12}" for n in names)
        lines.append(f"{label:<32} {_us(arms['plain']['median_us'])} {cells}")
    lines.append(f"{'':<32} " + " ".join(f"{p:>21}" for p in pairs))
    for label, scenario in rows:
        cells = " ".join(_interval(scenario[ratio_key].get(p)) for p in pairs)
        lines.append(f"{label:<32} {cells}")
    lines.append(_noise_line(rows, ratio_key))
    return "\n".join(lines)


def _label(s: dict[str, Any]) -> str:
    return f"{s['count']}x{s['numel']} {s['optimizer']} {s['impl']}"


def _distributed_lines(dist_result: dict[str, Any] | None) -> list[str]:
    """The 2-rank part's tables (none when it did not run)."""
    out: list[str] = []
    if not dist_result:
        return out
    ranks = f"{dist_result['world_size']} ranks gloo"
    if dist_result.get("pinned_to_own_cores"):
        ranks += " (each pinned to a core of its own)"
    for impl in ("foreach", "fused"):
        rows = [(_label(s), s) for s in dist_result["no_wrapper_steps"] if s["impl"] == impl]
        if rows:
            out += [
                "",
                f"{ranks}, precomputed grads, no wrapper, {impl}: overhead of step + update "
                "(slowest rank)",
                step_table(rows),
            ]
    out.append(
        "(fused: ShardedGradScaler makes no all-reduce and its ranks do not agree on a skip; "
        "sharded_unscaled calls unscale_() first, which makes the same collective as dscale)"
    )
    for mode in ("ddp", "fsdp2"):
        part = dist_result[mode]
        out += [
            "",
            f"{ranks}, {mode}, MLP {dist_result['depth']}x{dist_result['width']}: "
            "overhead of the whole step (backward included), then after backward",
            step_table([(f"{mode} whole step", part)]),
            step_table(
                [(f"{mode} after backward", part)], "after_backward_ratios", "after_backward"
            ),
        ]
    return out


def render(result: dict[str, Any]) -> str:
    """Every section of ``result`` as text tables."""
    out = [f"machine: {result['machine']}", f"load average: {result.get('loadavg', 'n/a')}"]
    out.append(LEGEND + f"; {LEVEL:.0%} intervals")
    if "single" in result:
        out += [
            "",
            "single process: overhead over the plain step (us, median of paired differences)",
            step_table([(_label(s), s) for s in result["single"]]),
        ]
        syncs = [(_label(s), s["host_syncs"]) for s in result["single"] if s["host_syncs"]]
        if syncs:
            out += ["", "host syncs per step (CUDA sync debug mode)"]
            out += [f"{label:<30} {counts}" for label, counts in syncs]
    if "device_path" in result:
        out += [
            "",
            "device-side decision (forced on the CPU; CUDA's own path on a GPU): overhead over "
            "the plain step (us, median of paired differences)",
            step_table([(_label(s), s) for s in result["device_path"]]),
        ]
        syncs = [(_label(s), s["host_syncs"]) for s in result["device_path"] if s["host_syncs"]]
        if syncs:
            out += ["", "host syncs per step on the device path (CUDA sync debug mode)"]
            out += [f"{label:<30} {counts}" for label, counts in syncs]
    if "phases" in result:
        out += ["", "where the time goes (SGD foreach; us, median / min)"]
        for split in result["phases"]:
            for name, per_phase in split["scalers"].items():
                cells = "  ".join(
                    f"{phase} {v['median_us']:8.1f} / {v['min_us']:8.1f}"
                    for phase, v in per_phase.items()
                )
                out.append(f"{split['count']}x{split['numel']:<10} {name:<8} {cells}")
    if "unscale_pass" in result:
        out += ["", "check-and-unscale pass vs torch._foreach_mul_ (ratio of median times)"]
        for s in result["unscale_pass"]:
            a = s["arms"]
            out.append(
                f"{s['count']}x{s['numel']:<20} mul {_us(a['foreach_mul']['median_us'])} us"
                f"  dscale {_us(a['dscale_unscale']['median_us'])} us  "
                + _interval(s["ratios"]["dscale_unscale/foreach_mul"])
            )
            if "gb_per_s" in s:
                rates = s["gb_per_s"]
                out.append(
                    f"{'':<24} GB/s (read + write): mul {rates['foreach_mul']:.0f}, dscale "
                    f"{rates['dscale_unscale']:.0f}, plain copy {rates['copy']:.0f}"
                )
    if "sweep" in result:
        sw = result["sweep"]
        rows = [(f"n={p['count']} x {p['numel']}", p) for p in sw["by_count"]]
        rows += [
            (f"{p['count']} x {p['numel']} ({p['bytes'] / 2**20:.1f} MiB)", p)
            for p in sw["by_bytes"]
        ]
        out += ["", "growth (SGD foreach): by tensor count, then by bytes", step_table(rows)]
        for name, s in sw["slopes"].items():
            out.append(
                f"slope {name:<7} {s['us_per_tensor']:8.3f} us/tensor {s['us_per_mib']:8.2f} us/MiB"
            )
    out += _distributed_lines(result.get("distributed"))
    return "\n".join(out)
