"""``python -m dscale.bench scaling``: dynamic and torch's scalers against policy="predictive".

Real fp16 (autocast) training runs of the launcher's GPT and MLP and of a model with a wide and
shifting gradient range, then the zoo of runs a rule tuned on smooth models can lose (periodic
spikes, a zero-gradient phase, an LR warm-up, gradients that drift up; ``_scaling_models``), same
seeds, init scales 2**16 and 2**32; see ``_scaling_runs`` for what is measured and
``_scaling_report`` for how it is reduced and which targets are checked.
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

from dscale.bench._scaling_models import ZOO
from dscale.bench._scaling_report import (
    check_targets,
    plot,
    render,
    render_targets,
    summarize,
)
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
#: The zoo runs longer: the spikes come at steps 97, 194 and 291.
ZOO_STEPS = {"full": 300, "quick": 300, "tiny": 4}
INITS = (2.0**16, 2.0**32)
PARTS = ("smooth", "zoo")


def run(config: str = "full", seeds: int | None = None, part: str = "smooth") -> dict[str, Any]:
    """Every group of runs of ``part``; returns the rows, the raw records and the machine's load."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    cfg = dict(CONFIGS[config])
    if part == "zoo":
        cfg.update(models=ZOO, steps=ZOO_STEPS[config])
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
        "part": part,
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
    parser.add_argument(
        "--only", choices=PARTS, help="the smooth models or the zoo alone (default: both)"
    )
    parser.add_argument("--seeds", type=int, help="number of seeds (default 3; quick 1)")
    parser.add_argument("--json", metavar="PATH", help="write the rows and every run's record")
    parser.add_argument("--png", metavar="PATH", help="draw scale and skipped steps over time")
    parser.add_argument("--config-for-tests", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = args.config_for_tests or ("quick" if args.quick else "full")
    results = [run(config, args.seeds, part) for part in ([args.only] if args.only else PARTS)]
    for result in results:
        print(render(result["rows"], result["cfg"]))  # noqa: T201
        result["targets"] = check_targets(result["rows"])
        print(render_targets(result["targets"]))  # noqa: T201
        print(  # noqa: T201
            f"{result['seconds']:.0f} s; load average before/after: "
            f"{result['loadavg'][0][0]:.2f} / {result['loadavg'][1][0]:.2f}\n"
        )
    if args.png:
        plot([r for result in results for r in result["runs"]], args.png)
    if args.json:
        out = []
        for result in results:
            item = dict(result)
            item["runs"] = [
                {**r, "records": {k: asdict(v) for k, v in r["records"].items()}}
                for r in result["runs"]
            ]
            out.append(item)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
