"""Command line of ``python -m dscale.bench``: pick sizes, run every section, print, write JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dscale.bench import _phases, _ranks, _single
from dscale.bench._arms import IMPLS, OPTIMIZERS
from dscale.bench._report import render

# Sizes: "small" is many small tensors, "large" few large ones. quick must stay under a minute
# on 2 shared cores (make bench); the full run takes a few minutes there.
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {
        "reps": 30,
        "small": (2000, 256),
        "large": (8, 4 * 2**20),
        "counts": [64, 256, 1024, 4096],
        "numel_for_count": 1024,
        "numels": [2**14, 2**16, 2**18, 2**20],
        "count_for_numel": 16,
        "dist": {
            "width": 1024,
            "depth": 8,
            "batch": 32,
            "reps": 60,
            "no_wrapper": [(2000, 1000), (20, 500_000)],
        },
    },
    "quick": {
        "reps": 8,
        "small": (500, 256),
        "large": (4, 2**20),
        "counts": [64, 256, 1024],
        "numel_for_count": 256,
        "numels": [2**14, 2**16, 2**18],
        "count_for_numel": 8,
        "dist": {
            "width": 256,
            "depth": 4,
            "batch": 16,
            "reps": 20,
            "no_wrapper": [(500, 1000), (10, 100_000)],
        },
    },
    "tiny": {  # tests only: every section, seconds
        "reps": 2,
        "small": (20, 64),
        "large": (2, 4096),
        "counts": [4, 16],
        "numel_for_count": 64,
        "numels": [256, 1024],
        "count_for_numel": 4,
        "dist": {"width": 16, "depth": 2, "batch": 4, "reps": 2, "no_wrapper": [(4, 64)]},
    },
}


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_single(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every single-process section: step overhead, unscale pass, growth sweep."""
    reps = cfg["reps"]
    single = [
        _single.step_overhead(count, numel, opt, impl, reps, device)
        for count, numel in (cfg["small"], cfg["large"])
        for opt in OPTIMIZERS
        for impl in IMPLS
    ]
    unscale = [_single.unscale_pass(c, n, reps, device) for c, n in (cfg["small"], cfg["large"])]
    sweep = _single.sweep(
        cfg["counts"], cfg["numel_for_count"], cfg["numels"], cfg["count_for_numel"], reps, device
    )
    split = [_phases.phases(c, n, reps, device) for c, n in (cfg["small"], cfg["large"])]
    return {
        "single": single,
        "device_path": _single.device_path(reps, device),
        "phases": split,
        "unscale_pass": unscale,
        "sweep": sweep,
    }


Scenario = tuple[int, int, str, str]  # count, numel, optimizer, impl


def parse_scenario(text: str) -> Scenario:
    """``COUNTxNUMEL:OPTIMIZER:IMPL`` (``8x4194304:sgd:fused``) -> a single-process scenario."""
    try:
        shape, optimizer, impl = text.split(":")
        count, numel = (int(n) for n in shape.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--scenario takes COUNTxNUMEL:OPTIMIZER:IMPL, e.g. 8x4194304:sgd:fused; got {text!r}"
        ) from None
    if count < 1 or numel < 1 or optimizer not in OPTIMIZERS or impl not in IMPLS:
        raise argparse.ArgumentTypeError(
            f"--scenario {text!r}: COUNT and NUMEL must be >= 1, OPTIMIZER one of {OPTIMIZERS}, "
            f"IMPL one of {IMPLS}"
        )
    return count, numel, optimizer, impl


def _dist_cfg(cfg: dict[str, Any], reps: int | None) -> dict[str, Any]:
    """Whole steps vary more than optimizer steps: the 2-rank part defaults to more reps."""
    return {**cfg["dist"], "reps": reps if reps is not None else cfg["dist"]["reps"]}


def run(
    config: str = "full",
    reps: int | None = None,
    device: str = "cpu",
    distributed: bool = True,
    threads: int = 1,
    scenarios: Sequence[Scenario] = (),
    device_path_only: bool = False,
) -> dict[str, Any]:
    """Run the benchmark in this process (plus spawned gloo ranks); returns the result dict.

    ``scenarios``: only these single-process step scenarios (no other section), to look at one
    row again with more repetitions; ``device_path_only``: only the device-side rows.
    """
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
    if reps is not None and reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here; use --device cpu")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads!r}")
    torch.set_num_threads(threads)
    cfg = dict(CONFIGS[config])
    if reps is not None:
        cfg["reps"] = reps
    dev = torch.device(device)
    start = time.perf_counter()
    result: dict[str, Any] = {"machine": machine_info(dev), "config": config, "reps": cfg["reps"]}
    load_at_start = os.getloadavg()
    if dist.is_initialized():  # under torchrun: this process is one of many ranks
        result["distributed"] = _ranks.run_here(_dist_cfg(cfg, reps))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            _ranks.single_rank_group(tmp)
            try:
                if device_path_only:
                    result["device_path"] = _single.device_path(cfg["reps"], dev)
                elif scenarios:
                    result["single"] = [
                        _single.step_overhead(count, numel, opt, impl, cfg["reps"], dev)
                        for count, numel, opt, impl in scenarios
                    ]
                else:
                    result.update(run_single(cfg, dev))
            finally:
                dist.destroy_process_group()
        if distributed and not scenarios and not device_path_only:
            result["distributed"] = _ranks.run_spawned(_dist_cfg(cfg, reps))
    result["seconds"] = time.perf_counter() - start
    # Other work on the machine widens every interval: say how busy it was (1-minute averages).
    result["loadavg"] = {"start": round(load_at_start[0], 2), "end": round(os.getloadavg()[0], 2)}
    return result


def _parser() -> argparse.ArgumentParser:
    """The single-process and 2-rank benchmark's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m dscale.bench",
        description="Per-step overhead of dscale.GradScaler, torch.amp.GradScaler and "
        "ShardedGradScaler over a plain optimizer step, measured interleaved in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument(
        "--reps",
        type=int,
        help="repetitions per arm (default 30, and 60 for the 2-rank part; quick 8 and 20)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="single-process part; cuda adds host-sync counts. The 2-rank part is gloo on CPU",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for the single-process part (default 1: steadier on shared cores)",
    )
    parser.add_argument("--no-distributed", action="store_true", help="skip the 2-rank part")
    parser.add_argument(
        "--scenario",
        action="append",
        type=parse_scenario,
        default=[],
        metavar="COUNTxNUMEL:OPT:IMPL",
        help="run only this single-process scenario (repeatable), e.g. 8x4194304:sgd:fused",
    )
    parser.add_argument(
        "--device-path",
        action="store_true",
        help="run only the device-side decision rows (8 and 200 Adam params, fused and foreach)",
    )
    parser.add_argument("--config-for-tests", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print the tables (rank 0 only) and write ``--json``.

    ``python -m dscale.bench scaling ...`` runs the scaling policies' benchmark instead, and
    ``python -m dscale.bench ops ...`` the op counts (``_ops_cli``), ``python -m dscale.bench
    fp8 ...`` the FP8 weight scales' (``_fp8_cli``), ``python -m dscale.bench compile ...`` the
    compiled region's compile and step times (``_compile_cli``), ``python -m dscale.bench
    precision-map`` a proposed precision map and its loss (``_precision_map``), ``python -m
    dscale.bench graph ...`` the compiled step replayed against eager (``_graph_cli``,
    ``.ci/gpu-check``'s graph part).
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["scaling"]:
        from dscale.bench._scaling_cli import main as scaling_main

        scaling_main(args_in[1:])
        return
    if args_in[:1] == ["fp8"]:
        from dscale.bench._fp8_cli import main as fp8_main

        fp8_main(args_in[1:])
        return
    if args_in[:1] == ["compile"]:
        from dscale.bench._compile_cli import main as compile_main

        compile_main(args_in[1:])
        return
    if args_in[:1] == ["graph"]:
        from dscale.bench._graph_cli import main as graph_main

        sys.exit(graph_main(args_in[1:]))
    if args_in[:1] == ["precision-map"]:
        from dscale.bench._precision_map import main as precision_map_main

        precision_map_main(args_in[1:])
        return
    if args_in[:1] == ["ops"]:
        from dscale.bench._ops_cli import main as ops_main

        ops_main(args_in[1:])
        return
    args = _parser().parse_args(args_in)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=_ranks.TIMEOUT)
    try:
        config = args.config_for_tests or ("quick" if args.quick else "full")
        result = run(
            config,
            args.reps,
            args.device,
            not args.no_distributed,
            args.threads,
            args.scenario,
            args.device_path,
        )
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        print(render(result))  # noqa: T201
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
