"""Two gloo ranks: rank-local attribution, and the rank-disagreement detector (one spawn)."""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

import torch
from prometheus_client import CollectorRegistry

import dscale
from dscale.metrics import RankScaleCheck, ScalerCollector
from dscale.scaler._program import agreement as _agreement
from dscale.stats import track_numerics
from tests.multirank import run_ranks
from tests.scaler._setup import batch, poison_first_grad, tiny_model, wrap


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _attribution(rank: int, parallel: str) -> dict[str, Any]:
    model = wrap(tiny_model(), parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = dscale.GradScaler(device="cpu", init_scale=2.0**10, growth_interval=1000)
    stats = track_numerics(scaler, model, every=1)
    check = RankScaleCheck(every=1)
    scaler.add_observer(check)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(batch(rank, step)).sum()).backward()
        if rank == 1 and step == 1:
            poison_first_grad(model)  # this rank's shard only
        scaler.step(opt)
        scaler.update()
    first_name = next(name for name, p in model.named_parameters() if p.grad is not None)
    return {
        "nonfinite": stats.read().nonfinite_grads,
        "first_name": first_name,
        "scale": scaler.get_scale(),
        "mismatches": check.mismatches,
    }


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"attribution": {p: _attribution(rank, p) for p in ("ddp", "fsdp2")}}

    # Metrics on rank 0 only (a common pattern): the check rides on the step's own collective,
    # so the ranks still run the same collectives and nothing hangs.
    out["rank0_only"] = _train_with_check(rank, init_scale=512.0, exporter=rank == 0)

    # A scale that differs across ranks: counted and logged on every rank, and exported.
    capture = _Capture()
    logging.getLogger("dscale.metrics").addHandler(capture)
    out["mismatch"] = _train_with_check(rank, init_scale=1024.0 * (rank + 1), exporter=True)
    out["mismatch"]["logs"] = capture.messages
    out["schedule"] = _schedule(rank)
    out["attached"] = _attached(rank)
    return out


def _schedule(rank: int) -> dict[str, Any]:
    """34 updates, scales differing by rank, a check every 5: when do ranges travel and count?"""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = dscale.GradScaler("cpu", init_scale=256.0 * (rank + 1), growth_interval=1000)
    check = RankScaleCheck(every=5)
    scaler.add_observer(check)
    lengths, checked_at = [], []
    real = _agreement.all_reduce_flag

    def counting(values, group):
        lengths.append(values.numel())
        return real(values, group)

    with mock.patch.object(_agreement, "all_reduce_flag", counting):
        for update in range(1, 35):
            scaler.scale(w.sum()).backward()
            scaler.step(opt)
            before = check.mismatches
            scaler.update()
            if check.mismatches > before:
                checked_at.append(update)
    return {"lengths": lengths, "checked_at": checked_at, "unchecked": check.unchecked}


def _attached(rank: int) -> dict[str, Any]:
    """DDP + attach(): the step's agreement runs (it checks the hooked grads again), so the
    scale range rides on it as without attach() and every due check is made."""
    model = wrap(tiny_model(), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = dscale.GradScaler(device="cpu", init_scale=512.0, growth_interval=1000)
    scaler.attach(model)
    check = RankScaleCheck(every=1)
    scaler.add_observer(check)
    unchecked = []
    for step in range(2 * _agreement.RANGE_EVERY):
        opt.zero_grad()
        scaler.scale(model(batch(rank, step)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        unchecked.append(check.unchecked)
    return {"unchecked": unchecked, "mismatches": check.mismatches}


def _train_with_check(rank: int, *, init_scale: float, exporter: bool) -> dict[str, Any]:
    model = wrap(tiny_model(), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = dscale.GradScaler(device="cpu", init_scale=init_scale, growth_interval=1000)
    labels = {"rank": str(rank), "local_rank": str(rank), "node": "n", "job_name": "j"}
    registry = CollectorRegistry()
    check = None
    if exporter:
        check = RankScaleCheck(every=1)
        scaler.add_observer(check)
        registry.register(ScalerCollector(scaler, labels=labels, rank_check=check))
    calls = []
    real = _agreement.all_reduce_flag

    def counting(values, group):
        calls.append(values.numel())
        return real(values, group)

    with mock.patch.object(_agreement, "all_reduce_flag", counting):
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(batch(rank, step)).sum()).backward()
            scaler.step(opt)
            scaler.update()
    result: dict[str, Any] = {"collectives": calls, "scale": scaler.get_scale()}
    if check is not None:
        result["count"] = check.mismatches
        result["min_max"] = (check.last_min, check.last_max)
        result["exported"] = registry.get_sample_value("dscale_rank_scale_mismatch_total", labels)
    return result


def test_rank_local_attribution_and_the_scale_disagreement_detector() -> None:
    out = run_ranks(_scenarios, timeout_s=240)
    for parallel in ("ddp", "fsdp2"):
        r0, r1 = out[0]["attribution"][parallel], out[1]["attribution"][parallel]
        assert r0["scale"] == r1["scale"] == 2.0**9, parallel  # both ranks skipped and backed off
        assert r0["mismatches"] == r1["mismatches"] == 0, parallel
        # Only rank 1 held the inf, so only rank 1 names the parameter.
        assert r1["nonfinite"] == {r1["first_name"]: 1, "other": 0}, parallel
        assert r0["nonfinite"] == {"other": 0}, parallel
    # One collective per step on every rank, with or without the check: the scale fields ride
    # on the first iteration's vector, the flag goes alone after it.
    assert out[0]["rank0_only"]["collectives"] == out[1]["rank0_only"]["collectives"] == [3, 1, 1]
    assert out[0]["rank0_only"]["count"] == 0
    assert out[0]["rank0_only"]["min_max"] == (512.0, 512.0)
    for rank in (0, 1):
        m = out[rank]["mismatch"]
        assert m["count"] == 1  # the one range of the three steps saw the two scales
        assert m["min_max"] == (1024.0, 2048.0)
        assert m["exported"] == 1.0
        assert any("ranks disagree on the loss scale" in msg for msg in m["logs"]), m["logs"]
        # The schedule, the same on both ranks: ranges on iterations 0, 16 and 32; a check due at
        # update 5 waits for the range of update 17, one due at 20 for that of update 33.
        s = out[rank]["schedule"]
        every = _agreement.RANGE_EVERY
        assert s["lengths"] == [3 if i % every == 0 else 1 for i in range(34)]
        assert s["checked_at"] == [17, 33] and s["unchecked"] == 0
        # attach(): the agreement runs each step, so no due check is left unchecked.
        a = out[rank]["attached"]
        assert a["mismatches"] == 0
        assert a["unchecked"] == [0] * (2 * every)
