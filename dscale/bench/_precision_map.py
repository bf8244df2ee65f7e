"""``python -m dscale.bench precision-map``: the map ShadowNumerics proposes, and its loss.

On the FP8 benchmark's GPT (``dscale.bench._fp8.MODELS``), one process, the CPU: the ``bf16``
arm trains under bf16 autocast with ``ShadowNumerics(every=...)`` over its first ``--probe``
steps, then ``propose_precision_map`` (the default thresholds unless given) names a format per
linear layer. Two more arms train from the same initial weights on the same batches: ``mxfp8``
(every layer torchao can take in MXFP8, emulated) and ``proposed`` (the proposed map applied at
step 0 by ``convert_to_float8``, one call per recipe). The table: the map with its reasons, and
per arm the mean loss of the last 10 steps and its relative difference from bf16's.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dscale import StepGuard
from dscale.bench import _fp8
from dscale.precision import ShadowNumerics, propose_precision_map
from dscale.precision._propose import MAX_FLUSHED, MAX_SATURATED

ARMS = ("bf16", "mxfp8", "proposed")


def apply_map(model: nn.Module, precision_map: dict[str, str]) -> None:
    """Convert each layer to its map's format (``bf16``: left), one conversion per recipe."""
    import dscale.fp8 as fp8

    for recipe in sorted(set(precision_map.values()) - {"bf16"}):

        def keep(name: str, module: nn.Module, recipe: str = recipe) -> bool:
            return precision_map.get(name) != recipe

        fp8.convert_to_float8(model, recipe=recipe, keep_high_precision=keep, emulate=True)  # type: ignore[arg-type]


def run_arm(
    arm: str, cfg: dict[str, Any], precision_map: dict[str, str] | None = None
) -> dict[str, Any]:
    """Train one arm; the bf16 arm also measures and proposes."""
    torch.manual_seed(cfg["seed"])
    model = _fp8.MODELS[cfg["model"]]()
    if arm == "mxfp8":
        import dscale.fp8 as fp8

        fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    elif arm == "proposed":
        apply_map(model, precision_map or {})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    guard = StepGuard("cpu")
    shadow = ShadowNumerics(model, guard, every=cfg["every"]) if arm == "bf16" else None
    losses: list[float] = []
    out: dict[str, Any] = {}
    for step in range(cfg["steps"]):
        tokens, target = _fp8.batch(step, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if shadow is not None and step + 1 == cfg["probe"]:
            proposal = propose_precision_map(
                shadow.window(),
                shadow.dims,
                formats=cfg["formats"],
                max_flushed=cfg["max_flushed"],
                max_saturated=cfg["max_saturated"],
                unmeasured=[n for n in shadow.dims if n not in shadow.measured],
            )
            out["map"], out["reasons"] = proposal.map, proposal.reasons
            out["window"] = shadow.window()
            out["samples"] = shadow.num_samples
            shadow.close()
            shadow = None
    out["losses"] = losses
    return out


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every arm; the proposal from the bf16 arm's probe."""
    bf16 = run_arm("bf16", cfg)
    arms = {"bf16": bf16, "mxfp8": run_arm("mxfp8", cfg)}
    arms["proposed"] = run_arm("proposed", cfg, bf16["map"])
    return {
        "config": cfg,
        "map": bf16["map"],
        "reasons": bf16["reasons"],
        "arms": arms,
        "window": bf16["window"],
        "samples": bf16["samples"],
    }


def _tail(losses: list[float]) -> float:
    tail = losses[-10:]
    return sum(tail) / len(tail)


def render(result: dict[str, Any]) -> str:
    """The proposal and the arms' losses, as text tables."""
    cfg = result["config"]
    lines = [
        f"precision map proposed on {cfg['model']} after {cfg['probe']} steps "
        f"({result['samples']} samples, every {cfg['every']}; formats {cfg['formats']}, "
        f"max_flushed {cfg['max_flushed']:g}, max_saturated {cfg['max_saturated']:g}):",
        "| layer | format | why |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {f} | {result['reasons'][n]} |" for n, f in sorted(result["map"].items())]
    base = _tail(result["arms"]["bf16"]["losses"])
    lines += [
        "",
        f"{cfg['steps']} steps, lr {cfg['lr']:g}, seed {cfg['seed']}, bf16 autocast, CPU "
        "(MXFP8 emulated):",
        "| arm | loss[0] | mean of last 10 | vs bf16 | max abs diff from bf16 (any step) |",
        "|---|---|---|---|---|",
    ]
    for arm in ARMS:
        losses = result["arms"][arm]["losses"]
        tail = _tail(losses)
        rel = (tail - base) / base if base else math.nan
        diff = max(abs(a - b) for a, b in zip(losses, result["arms"]["bf16"]["losses"]))
        lines.append(f"| {arm} | {losses[0]:.4f} | {tail:.4f} | {rel:+.2%} | {diff:.4f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run the arms, print the tables."""
    parser = argparse.ArgumentParser(
        prog="python -m dscale.bench precision-map", description=__doc__
    )
    parser.add_argument("--model", default="gpt", choices=sorted(_fp8.MODELS))
    parser.add_argument("--steps", type=int, default=60, help="steps per arm (default 60)")
    parser.add_argument("--probe", type=int, default=20, help="shadow steps before proposing")
    parser.add_argument("--every", type=int, default=5, help="ShadowNumerics(every=...)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--formats",
        default="mxfp8,rowwise,tensorwise",
        help="candidates, cheapest first (nvfp4 cannot train on the CPU)",
    )
    parser.add_argument("--max-flushed", type=float, default=MAX_FLUSHED)
    parser.add_argument("--max-saturated", type=float, default=MAX_SATURATED)
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    args = parser.parse_args(argv)
    if not 1 <= args.probe <= args.steps or args.every < 1:
        parser.error(
            f"need 1 <= --probe <= --steps and --every >= 1 (got {args.probe}, "
            f"{args.steps}, {args.every})"
        )
    cfg = {
        "model": args.model,
        "steps": args.steps,
        "probe": args.probe,
        "every": args.every,
        "lr": args.lr,
        "seed": args.seed,
        "formats": tuple(args.formats.split(",")),
        "max_flushed": args.max_flushed,
        "max_saturated": args.max_saturated,
    }
    result = run(cfg)
    print(render(result))  # noqa: T201
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
