"""``python -m dscale.bench scaling``: dynamic and torch's scalers against policy="predictive".

Real fp16 (autocast) training runs of the launcher's GPT and MLP and of a model with a wide and
shifting gradient range (``_scaling_models``), same seeds, init scales 2**16 and 2**32; see
``_scaling_runs`` for what is measured and ``_scaling_report`` for how it is reduced.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from dscale.bench._scaling_report import plot, render, summarize
from dscale.bench._scaling_runs import run_group

# full: docs/predictive.md's figures, minutes on 2 shared cores; tiny: the smoke test (seconds).
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {
        "models": ("gpt", "mlp", "wide"),
        "seeds": (0, 1, 2),
        "steps": 120,
        "early": 24,
        "every": 10,
        "seq_len": 32,
        "batch_size": 8,
        "lr": 3e-3,
    },
    "quick": {
        "models": ("gpt", "mlp", "wide"),
        "seeds": (0,),
        "steps": 110,
        "early": 20,
        "every": 10,
        "seq_len": 32,
        "batch_size": 8,
        "lr": 3e-3,
    },
    "tiny": {
        "models": ("gpt", "mlp", "wide"),
        "seeds": (0,),
        "steps": 4,
        "early": 2,
        "every": 2,
        "seq_len": 8,
        "batch_size": 2,
        "lr": 3e-3,
    },
}
INITS = (2.0**16, 2.0**32)


def run(config: str = "full", seeds: int | None = None) -> dict[str, Any]:
    """Every group of runs; returns the rows, the raw records and the machine's load."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
    cfg = dict(CONFIGS[config])
    if seeds is not None:
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds!r}")
        cfg["seeds"] = tuple(range(seeds))
    torch.set_num_threads(1)
    start = time.perf_counter()
    load_before = os.getloadavg()
    runs = [
        {"model": model, "seed": seed, "records": run_group(model, seed, INITS, cfg)}
        for model in cfg["models"]
        for seed in cfg["seeds"]
    ]
    return {
        "config": config,
        "cfg": cfg,
        "rows": summarize(runs, cfg["every"]),
        "runs": runs,
        "seconds": time.perf_counter() - start,
        "loadavg": [load_before, os.getloadavg()],
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse, run, print the table; write ``--json`` and ``--png``."""
    parser = argparse.ArgumentParser(
        prog="python -m dscale.bench scaling",
        description="Skipped steps, distance to the largest safe scale, underflow, final loss "
        "and step time of policy='predictive' against policy='dynamic' and torch's GradScaler, "
        "on real fp16 CPU training runs with the same seeds.",
    )
    parser.add_argument("--quick", action="store_true", help="one seed, fewer probes")
    parser.add_argument("--seeds", type=int, help="number of seeds (default 3; quick 1)")
    parser.add_argument("--json", metavar="PATH", help="write the rows and every run's record")
    parser.add_argument("--png", metavar="PATH", help="draw scale and skipped steps over time")
    parser.add_argument("--config-for-tests", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = args.config_for_tests or ("quick" if args.quick else "full")
    result = run(config, args.seeds)
    print(render(result["rows"], result["cfg"]))  # noqa: T201
    print(  # noqa: T201
        f"{result['seconds']:.0f} s; load average before/after: "
        f"{result['loadavg'][0][0]:.2f} / {result['loadavg'][1][0]:.2f}"
    )
    if args.png:
        plot(result["runs"], args.png)
    if args.json:
        out = dict(result)
        out["runs"] = [
            {**r, "records": {k: asdict(v) for k, v in r["records"].items()}}
            for r in result["runs"]
        ]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
