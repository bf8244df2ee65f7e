"""The issue-42 table (inf on one rank: dscale beside torch's GradScaler), measured, not assumed.

``python -m tests.parallel.table`` runs the two spawns (2 and 4 gloo ranks, about 30 s on 2 cores)
and prints the markdown table; ``python -m tests.parallel.table --json`` prints the rows. The tests
in ``test_meshes.py`` build the same rows from their own spawns and write both forms under pytest's
tmp dir (printed with ``-s``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from tests.parallel import _meshes

#: the settings in the table's order, with the words of its first column
SETTINGS = {
    "tp_replicated_first": "TP (2 ranks), the optimizer lists a replicated param first",
    "tp": "TP (2 ranks), a sharded param first",
    "tp_sp": "TP + sequence parallel (2 ranks)",
    "fsdp_tp": "FSDP2 x TP + SP, 2-D 2x2",
    "hsdp": "HSDP 2x2, inf after the reduction on one replica",
}


def decisions(runs: dict[int, dict[str, Any]]) -> str:
    """What each rank did at the poisoned step, in words ("all skip", "ranks 0, 2 step; ...")."""
    steps = {r: run["applied"][_meshes.INF_STEP] for r, run in runs.items()}
    if not any(steps.values()):
        return "all skip"
    if all(steps.values()):
        return "all step"
    stepped = ", ".join(str(r) for r, s in steps.items() if s)
    skipped = ", ".join(str(r) for r, s in steps.items() if not s)
    return f"rank(s) {stepped} step, {skipped} skip"


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def cell(setting: dict[int, dict[str, Any]], label: str) -> dict[str, Any]:
    """One scaler's outcome in one setting: decisions, scales, distance to the oracle."""
    runs = {r: out[label] for r, out in setting.items()}
    oracle = setting[0]["oracle"]["full"]
    replicas, held = setting[0]["replicas"]
    spread = 0.0
    for group in replicas:  # ranks that hold the same values (Replicate params, HSDP replicas)
        for r in group[1:]:
            spread = max(spread, max_diff(runs[group[0]][held], runs[r][held]))
    scales = sorted({run["scales"][_meshes.INF_STEP] for run in runs.values()})
    return {
        "decisions": decisions(runs),
        "scales": scales,
        "oracle_max_abs_diff": max(max_diff(run["full"], oracle) for run in runs.values()),
        "replica_max_abs_diff": spread,
    }


def rows(results: dict[int, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The table's rows from run_ranks' results, keyed by world size."""
    out = []
    for key, words in SETTINGS.items():
        for per_rank in results.values():
            if key in per_rank[0]:
                setting = {r: res[key] for r, res in per_rank.items()}
                out.append(
                    {
                        "setting": key,
                        "words": words,
                        "dscale": cell(setting, "dscale"),
                        "torch": cell(setting, "torch"),
                    }
                )
    return out


def _words(c: dict[str, Any]) -> str:
    scales = " vs ".join(f"{s:g}" for s in c["scales"])
    return (
        f"{c['decisions']}; scale {scales}; oracle {c['oracle_max_abs_diff']:.2g}; "
        f"replicas {c['replica_max_abs_diff']:.2g}"
    )


def markdown(table: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (max |param - oracle|, max |replica - replica|)."""
    lines = [
        "| setting (inf on one rank) | dscale.GradScaler | torch.amp.GradScaler |",
        "|---|---|---|",
    ]
    lines += [f"| {r['words']} | {_words(r['dscale'])} | {_words(r['torch'])} |" for r in table]
    return "\n".join(lines)


def measure() -> dict[int, dict[int, dict[str, Any]]]:
    """Run both spawns (the tests' own rank function)."""
    from tests.multirank import run_ranks
    from tests.parallel._ranks import run_settings

    return {w: run_ranks(run_settings, world_size=w, timeout_s=240) for w in (2, 4)}


if __name__ == "__main__":
    table = rows(measure())
    print(json.dumps(table, indent=1) if "--json" in sys.argv else markdown(table))
