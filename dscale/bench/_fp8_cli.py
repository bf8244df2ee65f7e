"""Command line of ``python -m dscale.bench fp8``: spawn 2 gloo ranks, run the arms, report.

Main table: per model, arms hp / torchao / dscale at lr 3e-3, AdamW betas (0.9, 0.95). Sweep
(``dscale`` arm, MLP): lr 1e-4, 3e-3, 1e-2 x betas (0.9, 0.95), (0.9, 0.999), an overflow
injected on rank 1 every 50 steps (agreed skips). ``--fallback`` adds the ``fallback`` arm
(``dscale`` with ``Float8Fallback``) and each FP8 arm's final-loss gap to ``hp``; ``--mxfp8``
the MXFP8 arms (``dscale/bench/_fp8_mx.py``: dscale's conversion against torchao's
``MXFP8Linear`` alone; ``--only-mxfp8`` runs those alone). Counts and
losses are deterministic; nothing here is timed.
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

from dscale.bench import _fp8, _fp8_mx

ARMS = ("hp", "torchao", "dscale")
LRS = (1e-4, 3e-3, 1e-2)
BETAS = ((0.9, 0.95), (0.9, 0.999))


def run_here(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every arm and sweep point on this rank (all ranks run the same list)."""
    rank = dist.get_rank()
    steps = cfg["steps"]
    # --predict exact: the dscale arm runs WeightScales(predict="exact") (still named dscale)
    ours = "dscale_exact" if cfg.get("predict") == "exact" else "dscale"
    arms_run: tuple[str, ...] = (*ARMS, "fallback") if cfg.get("fallback") else ARMS
    if cfg.get("only_mxfp8"):
        arms_run = ()
    table: dict[str, dict[str, Any]] = {}
    for model in cfg["models"]:
        table[model] = {
            arm: _fp8.run_arm(
                rank,
                model,
                ours if arm == "dscale" else arm,
                steps=steps,
                lr=3e-3,
                betas=(0.9, 0.95),
                fallback_threshold=cfg.get("fallback_threshold", 0.01),
                fallback_samples=cfg.get("fallback_samples", 3),
            )
            for arm in arms_run
        }
        if cfg.get("mxfp8") or cfg.get("only_mxfp8"):
            mx = {
                arm: _fp8_mx.run_mx_arm(rank, model, arm, steps=steps, lr=3e-3, betas=(0.9, 0.95))
                for arm in _fp8_mx.ARMS
            }
            ours_mx, theirs = mx["mxfp8_dscale"]["losses"], mx["mxfp8_torchao"]["losses"]
            mx["mxfp8_dscale"]["losses_equal_torchao_bitwise"] = ours_mx == theirs
            mx["mxfp8_dscale"]["max_abs_loss_diff_vs_torchao"] = max(
                abs(a - b) for a, b in zip(ours_mx, theirs)
            )
            table.setdefault(model, {}).update(mx)
    for arms in table.values():  # the "loss within 1e-3 of torchao's arm", per step
        if "dscale" not in arms:
            continue
        pairs = zip(arms["dscale"]["losses"], arms["torchao"]["losses"])
        arms["dscale"]["max_abs_loss_diff_vs_torchao"] = max(abs(a - b) for a, b in pairs)
        for arm, r in arms.items():  # final loss over hp's: the fallback's against dscale's
            if arm != "hp":
                r["loss_gap_to_hp"] = r["final_loss"] - arms["hp"]["final_loss"]
    sweep = []
    if cfg["sweep"]:
        inf_steps = tuple(range(25, steps, 50))
        for lr in LRS:
            for betas in BETAS:
                row = _fp8.run_arm(
                    rank, "mlp", ours, steps=steps, lr=lr, betas=betas, inf_steps=inf_steps
                )
                sweep.append({"lr": lr, "betas": list(betas), **row})
    return {
        "steps": steps,
        "predict": cfg.get("predict", "bound"),
        "fallback": bool(cfg.get("fallback")),
        "arms": table,
        "sweep": sweep,
    }


def _spawned(rank: int, world: int, store_path: str, cfg: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        result = run_here(cfg)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo ranks that ran FSDP2 may abort in C++ teardown; the result is written


def render(result: dict[str, Any]) -> str:
    """The tables as text."""
    lines = [
        f"FP8 weight scales, 2 gloo ranks, FSDP2 float8 all-gather, {result['steps']} steps, "
        f"dscale arm predict={result.get('predict', 'bound')}"
    ]
    head = f"{'model':5} {'arm':8} {'allreduce/step':>14} {'saturated':>9} {'min ratio':>9} "
    lines.append(head + f"{'loss':>8} {'ranks equal':>11}")
    for model, arms in result["arms"].items():
        for arm, r in arms.items():
            if arm in _fp8_mx.ARMS:
                continue
            ratio = "-" if r["min_scale_ratio"] is None else f"{r['min_scale_ratio']:.4f}"
            lines.append(
                f"{model:5} {arm:8} {r['collectives_per_step']:>14} "
                f"{r['saturated_weight_elements']:>9} {ratio:>9} {r['final_loss']:>8.4f} "
                f"{r['scales_equal_across_ranks']!s:>11}"
            )
    for model, arms in result["arms"].items():
        if "mxfp8_dscale" in arms:
            mx, ao = arms["mxfp8_dscale"], arms["mxfp8_torchao"]
            lines.append(
                f"{model} MXFP8 ({mx['recipe']}, {mx['mxfp8_layers']} layers, FSDP2 bf16 "
                f"all-gather): loss dscale {mx['final_loss']:.4f}, torchao alone "
                f"{ao['final_loss']:.4f}; every step bitwise equal: "
                f"{mx['losses_equal_torchao_bitwise']}; all-reduces/step dscale "
                f"{mx['collectives_per_step']}, torchao {ao['collectives_per_step']}"
            )
        if "dscale" not in arms:
            continue
        diff = arms["dscale"]["max_abs_loss_diff_vs_torchao"]
        lines.append(
            f"{model}: largest |loss(dscale) - loss(torchao)| over the steps, rank 0: {diff:.2e}"
        )
    for model, arms in result["arms"].items():
        if "fallback" not in arms:
            continue
        fb = arms["fallback"]["fallback"]
        lines.append(
            f"{model} fallback (threshold {fb['threshold']}, {fb['samples']} samples, numerics "
            f"every {fb['numerics_every']}; {fb['samples_taken']} samples): switched "
            f"{_layers(fb['switched'])}; passed but left in FP8 (float8 all-gather) "
            f"{_layers(fb['passed_but_left'])}; same on both ranks: {fb['agreed_on_ranks']}"
        )
        w = fb["largest_share_sampled"]
        lines.append(
            f"{model} largest sampled share: {w['share']:.2e} ({w['of']}, after step "
            f"{w['after_step']})"
        )
        lines.append(
            f"{model} final loss - hp's: fallback {arms['fallback']['loss_gap_to_hp']:.2e}, "
            f"dscale {arms['dscale']['loss_gap_to_hp']:.2e}"
        )
    if "telemetry" in result:
        t = result["telemetry"]
        lines.append(
            f"Float8Numerics(every=2), MLP: {t['extra_ops_unsampled']} extra aten ops on an "
            f"unsampled step, {t['extra_ops_sampled']} on a sampled one"
        )
    if result["sweep"]:
        lines.append("dscale arm, MLP, overflow injected on rank 1 (agreed skips):")
        lines.append(f"{'lr':>7} {'betas':>12} {'saturated':>9} {'min ratio':>9} {'skipped':>7}")
        for r in result["sweep"]:
            lines.append(
                f"{r['lr']:>7g} {tuple(r['betas'])!s:>12} {r['saturated_weight_elements']:>9} "
                f"{r['min_scale_ratio']:>9.4f} {r['skipped_steps']:>7}"
            )
    return "\n".join(lines)


def _layers(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['layer']} after step {r['after_step']}" for r in rows) or "none"


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, spawn the ranks, print the tables and write ``--json``."""
    parser = argparse.ArgumentParser(prog="python -m dscale.bench fp8", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument("--steps", type=int, default=200, help="steps per arm (default 200)")
    parser.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp")
    parser.add_argument("--no-sweep", action="store_true", help="skip the lr x betas sweep")
    parser.add_argument(
        "--predict",
        choices=("bound", "exact"),
        default="bound",
        help="the dscale arm's WeightScales(predict=...) (default bound)",
    )
    parser.add_argument(
        "--fallback",
        action="store_true",
        help="add the fallback arm: dscale's with Float8Numerics(every=10) and Float8Fallback",
    )
    parser.add_argument(
        "--fallback-threshold",
        type=float,
        default=0.01,
        help="the fallback arm's share threshold, in (0, 1) (default 0.01, Float8Fallback's)",
    )
    parser.add_argument(
        "--fallback-samples",
        type=int,
        default=3,
        help="the fallback arm's samples in a row, >= 1 (default 3, Float8Fallback's)",
    )
    parser.add_argument(
        "--mxfp8",
        action="store_true",
        help="add the MXFP8 arms: convert_to_float8(recipe='mxfp8') against torchao alone",
    )
    parser.add_argument(
        "--only-mxfp8", action="store_true", help="run the MXFP8 arms alone (no sweep)"
    )
    args = parser.parse_args(argv)
    if not 0.0 < args.fallback_threshold < 1.0 or args.fallback_samples < 1:
        parser.error(
            f"--fallback-threshold must be in (0, 1) (got {args.fallback_threshold}) and "
            f"--fallback-samples >= 1 (got {args.fallback_samples})"
        )
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in _fp8.MODELS]
    if bad or args.steps < 2:
        parser.error(f"--models takes {sorted(_fp8.MODELS)} (got {bad}); --steps must be >= 2")
    cfg = {
        "steps": args.steps,
        "models": models,
        "sweep": not args.no_sweep and not args.only_mxfp8,
        "predict": args.predict,
        "fallback": args.fallback,
        "mxfp8": args.mxfp8,
        "only_mxfp8": args.only_mxfp8,
        "fallback_threshold": args.fallback_threshold,
        "fallback_samples": args.fallback_samples,
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        start_processes(
            _spawned, args=(2, os.path.join(tmp, "store"), cfg, out), nprocs=2, start_method="spawn"
        )
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    result["machine"] = {"platform": platform.platform(), "torch": torch.__version__}
    if not args.only_mxfp8:
        result["telemetry"] = _fp8.telemetry_ops()
    print(render(result))  # noqa: T201
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
