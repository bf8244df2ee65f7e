"""``python -m dscale.bench compile``: the compiled region's compile time and CPU step time.

Compile time: the first call of ``step`` + ``update`` compiled fullgraph by Inductor, after the
eager warm-up, each in a fresh process (so nothing is cached in memory): with an empty Inductor
cache directory (cold), then with the directory that run filled (the FX graph cache warm). Step
time: the compiled region against eager dscale (the same configuration, the device-side decision
forced as in ``ops``) and torch's eager scaler, interleaved (``_timing.run_interleaved``), as the
overhead over the plain eager optimizer step, with bootstrap intervals on the ratios and an A/A
arm (a second compiled copy) that shows how wide plain noise makes them (``_stats``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dscale.bench import _ops, _ops_compiled, _stats
from dscale.bench._arms import make_scaler
from dscale.bench._timing import Arm, run_interleaved, summarize

CONFIGS = _ops_compiled.COMPILED_ARMS
PAIRS = (
    ("compiled", "dscale_eager"),
    ("compiled", "torch_eager"),
    ("dscale_eager", "torch_eager"),
    ("compiled_aa", "compiled"),
)


def _region(config: str, params: int) -> tuple[_ops._Setup, Any, Callable[[], None]]:
    """A setup, its scaler and the eager ``step`` + ``update`` region, after the warm-up."""
    row = _ops.Row("sgd", "foreach", params)
    cpu = torch.device("cpu")
    setup = _ops._Setup(row, cpu)
    optimizer = _ops.make_optimizer(setup.params, row)
    scaler = _ops_compiled._make(config, cpu)

    def region() -> None:
        scaler.step(optimizer)
        scaler.update()

    for _ in range(_ops.WARMUP):
        setup.load_grads()
        scaler.scale(setup.loss)
        region()
    return setup, scaler, region


def first_call_seconds(config: str, params: int) -> float:
    """Seconds of the first compiled call (the compile) in this process."""
    torch.set_num_threads(1)
    setup, scaler, region = _region(config, params)
    compiled = torch.compile(region, backend="inductor", fullgraph=True)
    setup.load_grads()
    scaler.scale(setup.loss)
    start = time.perf_counter()
    compiled()
    return time.perf_counter() - start


def _compile_in_fresh_process(config: str, params: int, cache_dir: str) -> float:
    code = (
        "from dscale.bench._compile_cli import first_call_seconds; "
        f"print(first_call_seconds({config!r}, {params}))"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {config} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def compile_times(config: str, params: int, reps: int) -> dict[str, Any]:
    """Cold and warm first-call seconds, ``reps`` of each (a new cache directory per cold one)."""
    cold, warm = [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold.append(_compile_in_fresh_process(config, params, cache_dir))
            warm.append(_compile_in_fresh_process(config, params, cache_dir))
    return {name: _spread(values) for name, values in (("cold", cold), ("warm", warm))}


def _spread(values: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(values),
        "min_s": min(values),
        "max_s": max(values),
        "seconds": values,
    }


def step_times(config: str, params: int, reps: int) -> dict[str, Any]:
    """Interleaved step times of the compiled region, eager dscale and eager torch (+ A/A)."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    row = _ops.Row("sgd", "foreach", params)
    arms = []
    plain = _ops._Setup(row, cpu)
    plain_opt = _ops.make_optimizer(plain.params, row)
    plain.load_grads()
    plain_opt.step()
    arms.append(Arm("plain", plain_opt.step, plain.load_grads))
    for name in ("compiled", "compiled_aa", "dscale_eager"):
        setup, scaler, region = _region(config, params)
        run = region
        if name != "dscale_eager":
            run = torch.compile(region, backend="inductor", fullgraph=True)

        def prepare(setup: _ops._Setup = setup, scaler: Any = scaler) -> None:
            setup.load_grads()
            scaler.scale(setup.loss)

        for _ in range(3):  # compile, and whatever the warm-up left to recompile
            prepare()
            run()
        arms.append(Arm(name, run, prepare))
    theirs = _ops._Setup(row, cpu)
    their_opt = _ops.make_optimizer(theirs.params, row)
    torch_scaler = make_scaler("torch", cpu)

    def torch_prepare() -> None:
        theirs.load_grads()
        torch_scaler.scale(theirs.loss)

    def torch_run() -> None:
        torch_scaler.step(their_opt)
        torch_scaler.update()

    arms.append(Arm("torch_eager", torch_run, torch_prepare))
    summary = summarize(run_interleaved(arms, reps, cpu), baseline="plain")
    ratios = _stats.compare(summary, PAIRS)
    for arm in summary.values():
        del arm["times_us"], arm["paired_overheads_us"]
    return {
        "arms": summary,
        "ratios": ratios,
        "noise": _stats.noise(ratios.get("compiled_aa/compiled")),
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"compiled step+update (Inductor, CPU, 1 thread, sgd foreach x{result['params']}); "
        f"{_stats.METHOD}",
    ]
    for config, by in result["configs"].items():
        lines.append(f"\n{_ops_compiled.short(config)}")
        if "error" in by:
            lines.append(f"  not compiled: {by['error']}")
            continue
        if "compile" in by:
            for kind, spread in by["compile"].items():
                lines.append(
                    f"  compile, {kind} cache: median {spread['median_s']:.1f} s "
                    f"(min {spread['min_s']:.1f}, max {spread['max_s']:.1f}; "
                    f"{len(spread['seconds'])} runs)"
                )
        steps = by["steps"]
        for name, arm in steps["arms"].items():
            lines.append(
                f"  {name:<13} median {arm['median_us']:8.1f} us, overhead over plain "
                f"{arm['overhead_median_us']:8.1f} us"
            )
        for pair, ratio in steps["ratios"].items():
            lines.append(
                f"  {pair:<26} {ratio['estimate']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}] "
                f"{ratio['verdict']}"
            )
        lines.append(f"  noise: {steps['noise']}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dscale.bench compile",
        description="Compile time (first call, cold and warm FX cache) and CPU step time of "
        "step+update compiled by Inductor, against eager dscale and eager torch.",
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument("--reps", type=int, default=200, help="timed step repetitions")
    parser.add_argument("--compile-reps", type=int, default=3, help="0: skip compile times")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(list(argv))
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "params": args.params,
        "configs": {},
    }
    for config in args.configs:
        try:
            entry: dict[str, Any] = {"steps": step_times(config, args.params, args.reps)}
        except Exception as exc:  # reported as torch said it: the region does not compile
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            result["configs"][config] = {"error": f"{type(exc).__name__}: {first}"}
            continue
        if args.compile_reps:
            entry["compile"] = compile_times(config, args.params, args.compile_reps)
        result["configs"][config] = entry
        one = {**result, "configs": {config: entry}}
        print(render(one).split("\n", 1)[1], flush=True)  # noqa: T201 - as each is done
    result["machine"]["load_average_after"] = os.getloadavg()
    print("\n" + render(result))  # noqa: T201
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
