"""Command line of ``python -m dscale.bench graph`` (``_graph``): run, print a line each, JSON.

``.ci/gpu-check``'s ``graph`` part runs it on a GPU (under ``torchrun`` over NCCL when there are
several); CI runs its CPU dry run (``tests/test_bench_graph.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dscale.bench import _graph
from dscale.bench._graph import CONFIGS, replay, step_times


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dscale.bench graph", description=_graph.__doc__
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument(
        "--mode", default=None, help='torch.compile mode (default: "reduce-overhead" on CUDA)'
    )
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per arm (default: 60 on CUDA, none on the CPU); 0: no timing",
    )
    parser.add_argument("--json", help="write the results here")
    return parser


def main(argv: Sequence[str]) -> int:
    """Run every configuration; print one line each (rank 0); 0 when all agree, else 1."""
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda: CUDA is not available here")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mode = args.mode or ("reduce-overhead" if cuda and args.backend == "inductor" else None)
    rank0 = not distributed or dist.get_rank() == 0
    if mode == "reduce-overhead":
        torch._logging.set_logs(cudagraphs=True)  # why a graph was skipped, if one is
    results: dict[str, Any] = {"device": str(device), "steps": args.steps, "configs": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "no float16 tensors" on the CPU's fp32 dry run
        try:
            for config in args.configs:
                res, compiled = replay(config, device, args.steps, args.backend, mode)
                reps = args.reps if args.reps is not None else (60 if cuda else 0)
                if reps > 0 and not distributed and "error" not in res:
                    res["timing"] = step_times(compiled, config, device, reps)
                results["configs"][config] = res
                if rank0:
                    print(_line(res), flush=True)  # noqa: T201
                    _write(args.json, results)  # after each: a run cut off keeps what it did
            if distributed:
                mine = {c: r.get("counters") for c, r in results["configs"].items()}
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                results["ranks_agree"] = all(e == every[0] for e in every)
        finally:
            if distributed:
                dist.destroy_process_group()
    ok = all(r["ok"] for r in results["configs"].values()) and results.get("ranks_agree", True)
    results["ok"] = ok
    if rank0:
        if "ranks_agree" in results:
            print(f"ranks agree: {results['ranks_agree']}")  # noqa: T201
        _write(args.json, results)
        print("graph: all agree" if ok else "graph: FAILED")  # noqa: T201
    return 0 if ok else 1


def _write(path: str | None, results: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


def _line(res: dict[str, Any]) -> str:
    head = f"{res['config']:<11} {res['backend']}/{res['mode']}: "
    if "error" in res:
        return head + f"FAILED to compile: {res['error']}"
    c = res["counters"]
    line = head + (
        f"{'ok' if res['ok'] else 'MISMATCH'}; counters equal {res['counters_equal']}, params "
        f"{'bitwise ' if res['exact'] else ''}equal {res['params_equal']} (max diff "
        f"{res['params_max_abs_diff']:.2g}), skipped {c['skipped_steps']:.0f} (infs injected "
        f"{res['injected_infs']}), host syncs in the region {res['host_syncs']} (whole "
        f"iterations: {res['iteration_syncs']}), recompiles "
        f"{res['recompiles']}, CUDA graph skips {res['cudagraph_skips']}, snapshot equal "
        f"{res['snapshot_equal']}"
    )
    timing = res.get("timing")
    if timing:
        r = timing["ratios"]
        parts = [
            f"{k} {v['estimate']:.2f} [{v['low']:.2f}, {v['high']:.2f}] {v['verdict']}"
            for k, v in r.items()
        ]
        us = timing["median_us"]
        line += (
            f"\n  step time (median us): plain {us['plain']:.0f}, torch eager {us['torch']:.0f}, "
            f"dscale compiled {us['dscale_compiled']:.0f}; overhead ratios: {'; '.join(parts)}; "
            f"{timing['noise']}"
        )
    return line
