"""Plain-text tables from the benchmark's result dict (the same dict ``--json`` writes)."""

from __future__ import annotations

from typing import Any

from dscale.bench._timing import ratio


def _us(value: float) -> str:
    return f"{value:9.1f}"


def _x(value: float) -> str:
    return f"{value:6.2f}" if value == value else "   n/a"  # NaN: an overhead <= 0, no ratio


def _ratios(arms: dict[str, Any], num: str, den: str) -> str:
    if num not in arms or den not in arms:
        return "       -      -"
    med = ratio(arms[num]["overhead_median_us"], arms[den]["overhead_median_us"])
    low = ratio(arms[num]["overhead_min_us"], arms[den]["overhead_min_us"])
    return f"{_x(med)} {_x(low)}"


def _overheads(arms: dict[str, Any], names: tuple[str, ...]) -> str:
    cells = []
    for name in names:
        cells.append(_us(arms[name]["overhead_median_us"]) if name in arms else "        -")
    return " ".join(cells)


def step_table(
    rows: list[tuple[str, dict[str, Any]]], names: tuple[str, ...], pairs: list[tuple[str, str]]
) -> str:
    """One line per scenario: plain step, each arm's overhead (us, median), overhead ratios."""
    head = f"{'scenario':<30} {'plain us':>9} " + " ".join(f"{n + ' +us':>9}" for n in names)
    head += "   " + " ".join(f"{num + '/' + den + ' med min':>14}" for num, den in pairs)
    lines = [head]
    for label, arms in rows:
        line = f"{label:<30} {_us(arms['plain']['median_us'])} {_overheads(arms, names)}   "
        line += " ".join(_ratios(arms, num, den) for num, den in pairs)
        lines.append(line)
    return "\n".join(lines)


def render(result: dict[str, Any]) -> str:
    """Every section of ``result`` as text tables."""
    out = [f"machine: {result['machine']}"]
    if "single" in result:
        rows = [
            (f"{s['count']}x{s['numel']} {s['optimizer']} {s['impl']}", s["arms"])
            for s in result["single"]
        ]
        out += [
            "",
            "single process: overhead over the plain step (us, median of paired diffs);",
            "ratios of overheads by median and by min",
            step_table(
                rows, ("dscale", "torch", "sharded"), [("dscale", "torch"), ("dscale", "sharded")]
            ),
        ]
        syncs = [
            (f"{s['count']}x{s['numel']} {s['optimizer']} {s['impl']}", s["host_syncs"])
            for s in result["single"]
            if s["host_syncs"]
        ]
        if syncs:
            out += ["", "host syncs per step (CUDA sync debug mode)"]
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
        out += ["", "check-and-unscale pass vs torch._foreach_mul_ (median and min time ratio)"]
        for s in result["unscale_pass"]:
            a = s["arms"]
            med = a["dscale_unscale"]["median_us"] / a["foreach_mul"]["median_us"]
            low = a["dscale_unscale"]["min_us"] / a["foreach_mul"]["min_us"]
            out.append(
                f"{s['count']}x{s['numel']:<20} mul {_us(a['foreach_mul']['median_us'])} us"
                f"  dscale {_us(a['dscale_unscale']['median_us'])} us  {_x(med)} {_x(low)}"
            )
    if "sweep" in result:
        sw = result["sweep"]
        rows = [(f"n={p['count']} x {p['numel']}", p["arms"]) for p in sw["by_count"]]
        rows += [
            (f"{p['count']} x {p['numel']} ({p['bytes'] / 2**20:.1f} MiB)", p["arms"])
            for p in sw["by_bytes"]
        ]
        out += [
            "",
            "growth (SGD foreach): by tensor count, then by bytes",
            step_table(rows, ("dscale", "torch"), [("dscale", "torch")]),
        ]
        for name, s in sw["slopes"].items():
            out.append(
                f"slope {name:<7} {s['us_per_tensor']:8.3f} us/tensor {s['us_per_mib']:8.2f} us/MiB"
            )
    dist_result = result.get("distributed")
    if dist_result:
        out += [
            "",
            f"{dist_result['world_size']} ranks gloo, MLP {dist_result['depth']}x"
            f"{dist_result['width']}: overhead of the whole step (backward included)",
        ]
        out.append(
            step_table(
                [
                    ("ddp whole step", dist_result["ddp"]["arms"]),
                    ("ddp after backward", dist_result["ddp"]["after_backward"]),
                ],
                ("dscale", "dscale+hook", "torch"),
                [("dscale", "torch"), ("dscale+hook", "torch")],
            )
        )
        out.append(
            step_table(
                [
                    ("fsdp2 whole step", dist_result["fsdp2"]["arms"]),
                    ("fsdp2 after backward", dist_result["fsdp2"]["after_backward"]),
                ],
                ("dscale", "dscale+hook", "sharded"),
                [("dscale", "sharded"), ("dscale+hook", "sharded")],
            )
        )
    return "\n".join(out)
