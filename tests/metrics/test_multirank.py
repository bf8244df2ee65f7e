"""Two gloo ranks: rank-local attribution, and the rank-disagreement detector (one spawn)."""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

import torch
from prometheus_client import CollectorRegistry

import dscale
from dscale import _agreement
from dscale.metrics import RankScaleCheck, ScalerCollector
from dscale.stats import track_numerics
from tests.multirank import run_ranks
from tests.scaler._setup import batch, poison_first_grad, tiny_model, wrap


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _FixedScaleScaler:
    """Only what RankScaleCheck and the collector read: a scale that differs per rank."""

    def __init__(self, scale: float) -> None:
        self._scale = torch.tensor(scale)

    def counters(self) -> dict[str, torch.Tensor]:
        return {"scale": self._scale}


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

    # A scale that differs across ranks: counted and logged on every rank, and exported.
    capture = _Capture()
    logging.getLogger("dscale.metrics").addHandler(capture)
    stub = _FixedScaleScaler(1024.0 * (rank + 1))
    check = RankScaleCheck(every=1)
    check.on_update(stub, torch.tensor(0.0))
    registry = CollectorRegistry()
    labels = {"rank": str(rank), "local_rank": str(rank), "node": "n", "job_name": "j"}
    registry.register(ScalerCollector(stub, labels=labels, rank_check=check))
    out["mismatch"] = {
        "count": check.mismatches,
        "min_max": (check.last_min, check.last_max),
        "exported": registry.get_sample_value("dscale_rank_scale_mismatch_total", labels),
        "logs": capture.messages,
    }

    # The check is one collective every `every` updates, through dscale._agreement.
    calls = []
    real = _agreement.all_reduce_min_max

    def counting(values, group):
        calls.append(1)
        return real(values, group)

    same = _FixedScaleScaler(512.0)
    check = RankScaleCheck(every=3)
    with mock.patch.object(_agreement, "all_reduce_min_max", counting):
        for _ in range(7):
            check.on_update(same, torch.tensor(0.0))
    out["collectives_in_7_updates"] = len(calls)
    out["equal_scales_mismatches"] = check.mismatches
    return out


def test_rank_local_attribution_and_the_scale_disagreement_detector() -> None:
    out = run_ranks(_scenarios, timeout_s=240)
    for parallel in ("ddp", "fsdp2"):
        r0, r1 = out[0]["attribution"][parallel], out[1]["attribution"][parallel]
        assert r0["scale"] == r1["scale"] == 2.0**9, parallel  # both ranks skipped and backed off
        assert r0["mismatches"] == r1["mismatches"] == 0, parallel
        # Only rank 1 held the inf, so only rank 1 names the parameter.
        assert r1["nonfinite"] == {r1["first_name"]: 1, "other": 0}, parallel
        assert r0["nonfinite"] == {"other": 0}, parallel
    for rank in (0, 1):
        m = out[rank]["mismatch"]
        assert m["count"] == 1
        assert m["min_max"] == (1024.0, 2048.0)
        assert m["exported"] == 1.0
        assert any("ranks disagree on the loss scale" in msg for msg in m["logs"]), m["logs"]
        assert out[rank]["collectives_in_7_updates"] == 2
        assert out[rank]["equal_scales_mismatches"] == 0
