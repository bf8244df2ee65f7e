"""``python -m dscale.bench ops``: the op-count table, its targets, and ``--json``.

Single process on ``--device`` (the CPU by default, where dscale's arms are forced onto the
device-side decision; ``cuda`` runs it for real, and ``--profile`` adds the GPU's own kernel
count), then 2 gloo ranks on the CPU: no wrapper (precomputed grads) and dscale's ``attach()``
under DDP. Deterministic: the same code gives the same counts, so CI holds the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

from dscale.bench import _ops, _ops_compiled, _ops_guard
from dscale.bench._ranks import single_rank_group

ATTACH = "dscale_attach"
RANK_ARMS = (*_ops.ARMS, ATTACH)
_SHORT = {
    "dscale": "dynamic",
    "dscale_sync_free": "sync_free",
    "dscale_predictive": "predictive",
    ATTACH: "attach",
}


def run_single(device: torch.device, profile: bool) -> dict[str, Any]:
    """Every row and arm in this process (ShardedGradScaler gets a 1-rank group, as it needs)."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ours = not dist.is_initialized()
        if ours:
            single_rank_group(tmp)
        try:
            for row in _ops.rows():
                out[row.name] = {
                    arm: _ops.measure(arm, row, device, profile=profile) for arm in _ops.ARMS
                }
        finally:
            if ours:
                dist.destroy_process_group()
    return out


def _rank_main(rank: int, world_size: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        cpu = torch.device("cpu")
        result: dict[str, Any] = {}
        for row in _ops.rows():
            if row.optimizer in _ops.WITHOUT_STATE:
                continue  # single process only: on ranks they would add nothing new
            result[row.name] = {arm: _ops.measure(arm, row, cpu) for arm in _ops.ARMS}
            result[row.name][ATTACH] = _ops.measure_attached("dscale", row, None)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int = 2) -> dict[str, Any]:
    """Every row on ``world_size`` spawned gloo ranks; rank 0's counts (every rank's must match)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts.json")
        args = (world_size, os.path.join(tmp, "store"), out)
        start_processes(_rank_main, args=args, nprocs=world_size, start_method="spawn")
        per_rank = []
        for rank in range(world_size):
            with open(f"{out}.{rank}") as f:
                per_rank.append(json.load(f))
    for rank, counts in enumerate(per_rank[1:], start=1):
        for row, arms in counts.items():
            for arm, result in arms.items():
                if result != per_rank[0][row][arm]:
                    raise RuntimeError(
                        f"{row} {arm}: rank {rank} counted {result}, rank 0 {per_rank[0][row][arm]}"
                    )
    return per_rank[0]


def check_targets(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 23's targets, row by row: each a dict with ``ok`` and what was compared."""
    checks: list[dict[str, Any]] = []

    def check(what: str, ok: bool, detail: str) -> None:
        checks.append({"target": what, "ok": bool(ok), "detail": detail})

    by_shape: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for name, arms in table.items():
        optimizer, impl, count = name.split()
        by_shape.setdefault((optimizer, impl), {})[int(count[1:])] = arms
        torch_k = arms["torch"]["kernels"]
        dyn, sync_free, pred = (arms[a] for a in _ops.DSCALE_ARMS)
        if ATTACH in arms:  # step + update after attach()'s hooks checked every grad
            attached = arms[ATTACH]
            check(f"{name}: attach <= torch", attached["kernels"] <= torch_k, _pair(attached, arms))
            if impl == "fused":
                check(
                    f"{name}: attach 0 host reads",
                    attached["host_reads"] == 0,
                    _pair(attached, arms),
                )
        if impl == "fused":
            check(f"{name}: dynamic <= torch", dyn["kernels"] <= torch_k, _pair(dyn, arms))
            check(f"{name}: dynamic 0 host reads", dyn["host_reads"] == 0, _pair(dyn, arms))
        check(
            f"{name}: sync_free <= 2x torch",
            sync_free["kernels"] <= 2 * torch_k,
            _pair(sync_free, arms),
        )
        check(
            f"{name}: sync_free 0 host reads", sync_free["host_reads"] == 0, _pair(sync_free, arms)
        )
        check(f"{name}: predictive <= torch + 6", pred["kernels"] <= torch_k + 6, _pair(pred, arms))
        reads = 0 if impl == "fused" else arms["torch"]["host_reads"]
        check(
            f"{name}: predictive host reads <= {reads:g}",
            pred["host_reads"] <= reads,
            _pair(pred, arms),
        )
    for (optimizer, impl), counts in by_shape.items():
        if len(counts) < 2:
            continue
        for arm in _ops.DSCALE_ARMS + ((ATTACH,) if ATTACH in next(iter(counts.values())) else ()):
            values = {n: counts[n][arm]["kernels"] for n in sorted(counts)}
            check(
                f"{optimizer} {impl}: {_SHORT[arm]} independent of the parameter count",
                len(set(values.values())) == 1,
                ", ".join(f"x{n}: {v:g}" for n, v in values.items()),
            )
    return checks


def _pair(result: dict[str, Any], arms: dict[str, Any]) -> str:
    theirs = arms["torch"]
    return (
        f"{result['kernels']:g} ops, {result['host_reads']:g} reads "
        f"(torch: {theirs['kernels']:g}, {theirs['host_reads']:g})"
    )


def render(table: dict[str, Any], arms: Sequence[str], title: str) -> str:
    """Rows by arms: kernel-launching ops / host reads / collectives, per iteration."""
    names = [_SHORT.get(a, a) for a in arms]
    lines = [title, f"{'row':<26}" + "".join(f"{n:>13}" for n in names)]
    for row, by_arm in table.items():
        cells = []
        for arm in arms:
            r = by_arm[arm]
            cell = f"{r['kernels']:g}/{r['host_reads']:g}/{r['collectives']:g}"
            if "cuda_kernels" in r:
                cell += f" ({r['cuda_kernels']:g})"
            cells.append(f"{cell:>13}")
        lines.append(f"{row:<26}" + "".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dscale.bench ops",
        description="Kernel-launching ops, host reads and collectives per iteration that each "
        "scaler adds to an optimizer step (device-side decision path), with the targets.",
    )
    parser.add_argument("--json", metavar="PATH", help="write every count here")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--profile", action="store_true", help="with --device cuda: the GPU's kernel count too"
    )
    parser.add_argument("--no-distributed", action="store_true", help="skip the 2-rank part")
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="skip the compiled column (Inductor compiles each arm: minutes on a cold cache)",
    )
    parser.add_argument(
        "--compiled-params",
        type=int,
        nargs="+",
        default=list(_ops.PARAM_COUNTS),
        metavar="N",
        help="parameter counts of the compiled column's rows (SGD foreach; default 8 200)",
    )
    args = parser.parse_args(list(argv))
    if args.profile and args.device != "cuda":
        parser.error("--profile counts the GPU's kernels: it needs --device cuda")
    device = torch.device(args.device)
    # Counts do not depend on threads; one spares a loaded machine the CPU kernels' thread spin.
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "units": "per iteration: kernel-launching ops / host reads / collectives, the plain "
        "optimizer step's subtracted; (n): kernels the GPU ran, by the profiler",
        "single": run_single(device, args.profile),
    }
    lines = [render(result["single"], _ops.ARMS, f"single process on {device.type}")]
    checks = check_targets(result["single"])
    result["step_guard"] = _ops_guard.run_guard(device)  # StepGuard, spike gate on and off
    lines += ["", render(result["step_guard"], _ops_guard.GUARD_ARMS, "StepGuard (bf16/fp32)")]
    checks += _ops_guard.check_guard_targets(result["step_guard"])
    if not args.no_compiled:
        rows = tuple(_ops.Row("sgd", "foreach", n) for n in args.compiled_params)
        result["compiled"] = _ops_compiled.run_compiled(rows)
        lines += ["", _ops_compiled.render_compiled(result["compiled"])]
        checks += _ops_compiled.check_compiled_targets(result["compiled"])
    if not args.no_distributed:
        result["ranks2"] = run_ranks()
        lines += ["", render(result["ranks2"], RANK_ARMS, "2 gloo ranks (no wrapper; attach: DDP)")]
        checks += check_targets(result["ranks2"])
    result["targets"] = checks
    failed = [c for c in checks if not c["ok"]]
    lines += ["", f"targets: {len(checks) - len(failed)} of {len(checks)} met"]
    lines += [f"  NOT MET {c['target']}: {c['detail']}" for c in failed]
    print("\n".join(lines))  # noqa: T201
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
