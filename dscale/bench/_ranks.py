"""Multi-rank scenarios on gloo (CPU): precomputed grads with no wrapper, DDP and FSDP2.

No wrapper: each rank holds precomputed scaled grads and steps SGD, as a pipeline stage or a
manually sharded model does; the overhead is step + update over a plain step, and every scaler
but torch's makes the same one-element all-reduce. Under DDP and FSDP2 the overhead is measured on
the whole step, backward included, because dscale's DDP hook moves the unscale into the gradient
all-reduce; the part after backward (step + update) is also reported on its own, as it is far less
noisy than a whole step with gloo all-reduces. Every arm has its own model (same initial weights)
and optimizer; the arms run interleaved in the same order on every rank. A repetition's time is
the slowest rank's. ShardedGradScaler is the peer (it makes the same collective); a second copy
of it is the A/A arm.

Run either inside ``torchrun`` (``WORLD_SIZE`` set: this process is one rank) or by spawning
``world_size`` local processes that meet through a ``FileStore``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes

from dscale.bench._arms import FLOOR, make_scaler
from dscale.bench._single import Grads, step_arms
from dscale.bench._stats import compare
from dscale.bench._timing import Arm, run_interleaved, summarize

TIMEOUT = timedelta(seconds=120)
WARMUP = 2
PEER_PAIRS = (("dscale", "sharded"), ("dscale+hook", "sharded"), ("sharded_aa", "sharded"))
NO_WRAPPER_ARMS = ("dscale", "torch", "sharded", "sharded_aa", FLOOR)
NO_WRAPPER_PAIRS = (
    ("dscale", "sharded"),
    ("dscale", "torch"),
    ("sharded_aa", "sharded"),
    (FLOOR, "sharded"),
)
# Fused optimizers: ShardedGradScaler makes no collective there (its ranks do not agree), so the
# peer that makes the same collective as dscale is it with unscale_() first.
FUSED_ARMS = (*NO_WRAPPER_ARMS, "sharded_unscaled")
FUSED_PAIRS = (("dscale", "sharded_unscaled"), *NO_WRAPPER_PAIRS, (FLOOR, "sharded_unscaled"))


def single_rank_group(tmp: str) -> None:
    """ShardedGradScaler all-reduces even alone: give it a 1-rank gloo group (dscale skips it)."""
    store = dist.FileStore(  # type: ignore[attr-defined]
        os.path.join(tmp, "store"), 1
    )
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )


def _mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


class _TrainStep:
    """One training step; also records the time after backward (the scaler's step + update)."""

    def __init__(
        self, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, scaler: Any | None
    ) -> None:
        self.model, self.opt, self.x, self.scaler = model, opt, x, scaler
        self.after_backward: list[float] = []

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(self.x).square().mean()
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        start = time.perf_counter()
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
        self.after_backward.append(time.perf_counter() - start)


def _arm(name: str, model: nn.Module, x: torch.Tensor, scaler: Any | None) -> Arm:
    opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9, foreach=True)
    return Arm(name, _TrainStep(model, opt, x, scaler))


def _ddp_arms(width: int, depth: int, x: torch.Tensor) -> list[Arm]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    cpu = torch.device("cpu")
    arms = [_arm("plain", DDP(_mlp(width, depth)), x, None)]
    arms += [
        _arm(n, DDP(_mlp(width, depth)), x, make_scaler(n, cpu))
        for n in ("dscale", "torch", "sharded", "sharded_aa")
    ]
    model = DDP(_mlp(width, depth))
    scaler = make_scaler("dscale", cpu)
    scaler.attach(model)
    arms.append(_arm("dscale+hook", model, x, scaler))
    return arms


def _fsdp_arms(width: int, depth: int, x: torch.Tensor) -> list[Arm]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cpu = torch.device("cpu")

    def sharded() -> nn.Module:
        model = _mlp(width, depth)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    arms = [_arm("plain", sharded(), x, None)]
    arms += [
        _arm(n, sharded(), x, make_scaler(n, cpu)) for n in ("dscale", "sharded", "sharded_aa")
    ]
    model, scaler = sharded(), make_scaler("dscale", cpu)
    scaler.attach(model)
    arms.append(_arm("dscale+hook", model, x, scaler))
    return arms


def _aligned(arms: list[Arm]) -> list[Arm]:
    """Each arm starts on every rank at once: a barrier after its (untimed) prepare.

    Without it, an arm with a collective absorbs the drift between the ranks that the arms
    without one (the plain step, torch's scaler) let build up, and is charged for it.
    """

    def prepared(arm: Arm) -> Callable[[], None]:
        def prepare() -> None:
            if arm.prepare is not None:
                arm.prepare()
            dist.barrier()

        return prepare

    return [Arm(arm.name, arm.run, prepared(arm)) for arm in arms]


def _slowest_rank(times: dict[str, list[float]]) -> dict[str, list[float]]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {name: [max(t) for t in zip(*(g[name] for g in gathered))] for name in times}


def _no_wrapper(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Precomputed grads, no wrapper: every size in ``cfg["no_wrapper"]``, foreach and fused."""
    cpu = torch.device("cpu")
    out = []
    for count, numel in cfg["no_wrapper"]:
        for impl in ("foreach", "fused"):
            grads = Grads(count, numel, cpu, seed=dist.get_rank())
            names, pairs = (
                (FUSED_ARMS, FUSED_PAIRS)
                if impl == "fused"
                else (NO_WRAPPER_ARMS, NO_WRAPPER_PAIRS)
            )
            arms = step_arms(grads, "sgd", impl, cpu, names)
            times = _slowest_rank(run_interleaved(_aligned(arms), cfg["reps"], cpu, WARMUP))
            summary = summarize(times, "plain")
            out.append(
                {
                    "count": count,
                    "numel": numel,
                    "optimizer": "sgd",
                    "impl": impl,
                    "arms": summary,
                    "ratios": compare(summary, pairs),
                }
            )
    return out


def run_here(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Run every multi-rank scenario on this rank; rank 0 returns the summary, others None."""
    torch.manual_seed(1 + dist.get_rank())  # each rank its own data, as in data parallelism
    x = torch.randn(cfg["batch"], cfg["width"])
    out: dict[str, Any] = {"world_size": dist.get_world_size(), **cfg}
    out["no_wrapper_steps"] = _no_wrapper(cfg)
    for name, build in (("ddp", _ddp_arms), ("fsdp2", _fsdp_arms)):
        arms = build(cfg["width"], cfg["depth"], x)
        timed = _aligned(arms)
        times = _slowest_rank(run_interleaved(timed, cfg["reps"], torch.device("cpu"), WARMUP))
        after = {a.name: a.run.after_backward[WARMUP:] for a in arms}  # type: ignore[attr-defined]
        pairs = PEER_PAIRS + ((("dscale", "torch"),) if name == "ddp" else ())
        whole, after_backward = summarize(times, "plain"), summarize(_slowest_rank(after), "plain")
        out[name] = {
            "arms": whole,
            "after_backward": after_backward,
            "ratios": compare(whole, pairs),
            "after_backward_ratios": compare(after_backward, pairs),
        }
    return out if dist.get_rank() == 0 else None


def pin_to_own_core(rank: int, world_size: int) -> int | None:
    """Pin this rank (and the gloo threads it starts) to a core of its own; return the core.

    Left to the scheduler, ranks and their gloo threads migrate and share cores, and a
    2-rank A/A ratio on 2 cores swung +-20%; pinned it stayed within +-6% (issue 14's runs).
    Nothing is pinned where the process may use fewer cores than there are ranks.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world_size:
        return None
    os.sched_setaffinity(0, {cores[rank]})
    return cores[rank]


def _spawned(rank: int, world_size: int, store_path: str, cfg: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)  # one core per rank; more would fight over the same cores
    core = pin_to_own_core(rank, world_size)
    store = dist.FileStore(  # type: ignore[attr-defined]
        store_path, world_size
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = run_here(cfg)
        if result is not None:
            result["pinned_to_own_cores"] = core is not None
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
    # About one run in four, a spawned gloo rank that ran DDP and FSDP2 aborts after the last
    # Python frame, in C++ teardown ("terminate called without an active exception"), with or
    # without dscale's hooks. The result is on disk by now: leave without running destructors.
    os._exit(0)


def run_spawned(cfg: dict[str, Any], world_size: int = 2) -> dict[str, Any]:
    """Spawn ``world_size`` local gloo ranks, run the scenarios, return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = (world_size, os.path.join(tmp, "store"), cfg, out)
        start_processes(_spawned, args=args, nprocs=world_size, start_method="spawn")
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    return result
