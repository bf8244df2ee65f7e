"""Float8Numerics on 2 gloo ranks under DDP: layouts compared, and no collective when unsampled.

Issue 41 item 7: ranks that converted different layers sent vectors of different lengths (gloo:
a reset connection on one rank, a hang on the other) or, with as many layers, each read the
peer's rows under its own names; construction now compares the layouts and raises
LayoutMismatchError on every rank. Oracle for the agreed rows: each rank's own amaxes, measured
by a hook of the test's, and their MAX over the ranks.

Issue 41 item 8: under attach(), DDP's reduction makes the overflow flag global and the scaler
runs no agreement collective of its own; with numerics registered it ran one on every step,
sampled or not. Oracle: the same run without numerics, counted step by step (the agreement
seam, every all-reduce the profiler sees, and every aten op).

One spawn runs every scenario (a module fixture); each test asserts on its part.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import dscale
import dscale.fp8 as fp8
from dscale.scaler._program import agreement as _agreement
from tests.fp8 import _models
from tests.multirank import run_ranks

KEEP = {  # per case, what each rank keeps in high precision
    "same": {0: None, 1: None},
    "counts": {0: None, 1: ["blocks.1.fc2"]},  # rank 1 has 3 float8 layers, rank 0 has 4
    "names": {0: ["blocks.0.fc1"], 1: ["blocks.1.fc2"]},  # 3 each, not the same 3
}


def _ddp_model(keep: list[str] | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    from torch.nn.parallel import DistributedDataParallel

    model = _models.net()
    fp8.convert_to_float8(model, keep_high_precision=keep, emulate=True)
    return model, DistributedDataParallel(model)


def _train_step(model: torch.nn.Module, guard: Any, opt: Any, step: int, rank: int) -> None:
    tokens, target = _models.batch(step, rank)
    guard.scale(_models.loss_of(model, tokens, target)).backward()
    guard.step(opt)
    guard.update()
    opt.zero_grad()


def _all(rank: int, world: int) -> dict[str, Any]:
    """Every scenario of this file in one spawn (2 gloo ranks). The layout mismatches last:
    they end in a refusal on both ranks."""
    return {
        "collectives": _collectives(rank, world),
        "two_optimizers": _two_optimizers(rank, world),
        "layouts": _layouts(rank, world),
    }


@pytest.fixture(scope="module")
def spawned() -> dict[int, dict[str, Any]]:
    return run_ranks(_all, world_size=2, timeout_s=300.0)


def _layouts(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, keep in KEEP.items():
        model, wrapped = _ddp_model(keep[rank])
        if rank == 1:  # an outlier on rank 1 only (before the hook below reads the input)
            model.blocks[0].fc1.register_forward_pre_hook(lambda module, args: (args[0] * 100.0,))
        local: dict[str, float] = {}
        for name, module in model.named_modules():
            if name in ("blocks.0.fc1", "blocks.1.fc2"):

                def own(module, args, name=name, local=local):
                    local[name] = args[0].detach().abs().amax().item()

                module.register_forward_pre_hook(own)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        guard = dscale.StepGuard("cpu")
        try:
            numerics = fp8.Float8Numerics(wrapped, guard, every=1)
            _train_step(wrapped, guard, opt, 0, rank)
            out[case] = {"error": None, "snapshot": numerics.snapshot(), "local": local}
        except fp8.LayoutMismatchError as exc:
            out[case] = {"error": ("LayoutMismatchError", str(exc))}
    return out


def test_ranks_that_measure_other_layers_raise_layout_mismatch_on_every_rank_ddp(spawned):
    out = {rank: got["layouts"] for rank, got in spawned.items()}
    for case in ("counts", "names"):
        errors = [out[rank][case]["error"] for rank in (0, 1)]
        assert all(e is not None and e[0] == "LayoutMismatchError" for e in errors), errors
        assert errors[0] == errors[1]  # the same message on both ranks, naming both sides
    assert "rank 0: 4 layers, only here: ['blocks.1.fc2 (64->32)']" in out[0]["counts"]["error"][1]
    assert "rank 1: 3 layers, only here: none" in out[0]["counts"]["error"][1]
    names = out[0]["names"]["error"][1]
    assert "rank 0: 3 layers, only here: ['blocks.1.fc2 (64->32)']" in names
    assert "rank 1: 3 layers, only here: ['blocks.0.fc1 (32->64)']" in names
    # The same layouts: each agreed row is the MAX over the ranks of their own amaxes.
    same = [out[rank]["same"] for rank in (0, 1)]
    assert same[0]["error"] is None and same[0]["snapshot"] == same[1]["snapshot"]
    for layer in ("blocks.0.fc1", "blocks.1.fc2"):
        want = max(same[r]["local"][layer] for r in (0, 1))
        if layer == "blocks.0.fc1":  # rank 1's x100 input is the larger
            assert same[1]["local"][layer] > same[0]["local"][layer]
        assert same[0]["snapshot"][f"{layer}/input"]["amax"] == want


def _collectives(rank: int, world: int) -> dict[str, Any]:
    agreements = [0]
    seam = _agreement.all_reduce_flag

    def counting(values, group):
        agreements[0] += 1
        return seam(values, group)

    _agreement.all_reduce_flag = counting
    out: dict[str, Any] = {}
    try:
        for arm in ("without", "with"):
            _, wrapped = _ddp_model(None)
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            guard = dscale.StepGuard("cpu")
            guard.attach(wrapped)
            numerics = fp8.Float8Numerics(wrapped, guard, every=2) if arm == "with" else None
            dist.barrier()
            rows = []
            for step in range(5):
                agreements[0] = 0
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    _train_step(wrapped, guard, opt, step, rank)
                names = [e.name for e in prof.events()]
                # attach()'s per-bucket check runs in DDP's comm-hook callback, on whichever
                # thread completes the bucket's future, in or after the window by timing: the
                # ops compared are the others (the step's own re-check is counted in the
                # scaler's op-count tests).
                ops = [n for n in names if n != "aten::_amp_foreach_non_finite_check_and_unscale_"]
                rows.append(
                    {
                        "agreements": agreements[0],
                        "allreduces": sum(1 for n in names if n == "c10d::allreduce_"),
                        "ops": sum(1 for n in ops if n.startswith("aten::")),
                    }
                )
            samples = None if numerics is None else numerics.num_samples
            out[arm] = {"rows": rows, "samples": samples}
    finally:
        _agreement.all_reduce_flag = seam
    return out


def test_unsampled_steps_run_the_collectives_and_ops_of_a_run_without_numerics_under_attach(
    spawned,
):
    out = {rank: got["collectives"] for rank, got in spawned.items()}
    for rank in (0, 1):
        without, with_ = out[rank]["without"]["rows"], out[rank]["with"]["rows"]
        assert out[rank]["with"]["samples"] == 3  # steps 0, 2, 4
        # attach() keeps the scaler's one agreement all-reduce (it checks the hooked grads again,
        # and a write on one rank must be agreed): one per step, with or without numerics.
        assert [r["agreements"] for r in without] == [1] * 5, without
        for step in (1, 3):  # unsampled: not one collective or op more
            assert with_[step] == without[step], (rank, step, with_[step], without[step])
        for step in (0, 2, 4):  # sampled: the values ride that same all-reduce, no second one
            assert with_[step]["agreements"] == 1, (rank, step)
            assert with_[step]["allreduces"] == without[step]["allreduces"], (rank, step)


def _two_optimizers(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ("one", "two"):
        model, wrapped = _ddp_model(None)
        if rank == 1:  # an outlier on rank 1 only: the agreed sample is rank 1's
            model.blocks[1].fc2.register_forward_pre_hook(
                lambda module, args: (args[0] + 1e4 * (args[0] == args[0].max()),)
            )
        params = list(wrapped.parameters())
        groups = (
            [params[: len(params) // 2], params[len(params) // 2 :]] if arm == "two" else [params]
        )
        opts = [torch.optim.AdamW(g, lr=1e-3) for g in groups]
        guard = dscale.StepGuard("cpu")
        guard.attach(wrapped)
        numerics = fp8.Float8Numerics(wrapped, guard, every=2)
        fallback = fp8.Float8Fallback(numerics, guard, threshold=0.05, samples=2)
        rows = []
        for step in range(5):
            tokens, target = _models.batch(step, rank)
            loss = _models.loss_of(wrapped, tokens, target)
            guard.scale(loss).backward()
            for opt in opts:
                guard.step(opt)
            guard.update()
            for opt in opts:
                opt.zero_grad()
            rows.append((loss.item(), numerics.snapshot(), list(fallback.fallen)))
        out[arm] = {"rows": rows, "counts": (numerics.num_steps, numerics.num_samples)}
    return out


def test_two_optimizers_under_attach_sample_and_switch_as_one_optimizer_on_two_ranks(spawned):
    """Review of issue 41 (items 8, 9): the numerics counted each optimizer's step(), so with
    two optimizers under DDP and attach() ``every=2`` sampled every iteration (and with
    ``every=1`` the second optimizer's step sent zeros). Oracle: the same DDP training with one
    AdamW over all parameters, on both ranks: the same agreed samples (rank 1's outlier on both
    ranks), switched layers and losses at every iteration, and no hang."""
    out = {rank: got["two_optimizers"] for rank, got in spawned.items()}
    for rank in (0, 1):
        one, two = out[rank]["one"], out[rank]["two"]
        assert one["counts"] == (5, 3)  # iterations 0, 2, 4 sampled
        assert any(rows[2] for rows in one["rows"])  # the oracle switches a layer
        assert [r[1:] for r in two["rows"]] == [r[1:] for r in one["rows"]], rank
        assert [r[0] for r in two["rows"]] == [r[0] for r in one["rows"]], rank
        assert two["counts"] == one["counts"]
    assert [r[1:] for r in out[0]["two"]["rows"]] == [r[1:] for r in out[1]["two"]["rows"]]
