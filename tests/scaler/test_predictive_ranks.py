"""policy="predictive" on 2 gloo ranks: every rank sets the same scale, from the MAX over ranks."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tests.multirank import run_ranks
from tests.scaler._setup import batch, full_params, tiny_model, wrap


def _local_max(model: torch.nn.Module, scale: float) -> float:
    largest = 0.0
    for p in model.parameters():
        grad = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
        if grad is not None and grad.numel():
            largest = max(largest, (grad.abs().max() / scale).item())
    return largest


def _train(
    rank: int,
    parallel: str | None,
    *,
    attach: bool,
    reduce: bool,
    steps: int = 5,
    abandon: bool = False,
) -> dict[str, Any]:
    import dscale
    import dscale.scaler._program.agreement as agreement
    from dscale.scaler._program import predictive as _predictive

    model = tiny_model()
    if parallel is not None:
        model = wrap(model, parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", policy="predictive", growth_interval=2)
    if attach:
        scaler.attach(model)
    real = agreement.all_reduce_flag
    sizes: list[int] = []

    def counting(values: torch.Tensor, group: Any) -> Any:
        sizes.append(values.numel())
        return real(values, group) if reduce else None

    agreement.all_reduce_flag = counting
    scales, expected, entries = [], [], []
    try:
        for step in range(steps):
            opt.zero_grad()
            if abandon and step == 2:  # a loss-spike filter: backward, then drop the batch
                scaler.scale(model(batch(rank, 99)).square().mean() * 300.0).backward()
                opt.zero_grad()
            # Rank 1's loss is 16x rank 0's: without DDP its grads are 16x larger.
            loss = model(batch(rank, step)).square().mean() * (16.0 if rank == 1 else 1.0)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            # The oracle, with the test's own collective (not counted): the target from the
            # largest magnitude over both ranks, from the grads as the step sees them.
            local = [0.0] if attach else [_local_max(model, scale)]
            both = [None, None]
            dist.all_gather_object(both, local[0])
            # The rule, written out: the largest power of two keeping the largest magnitude
            # of the window (8 steps) times the margin within fp16's range.
            entries.append(max(both))
            largest = max(entries[-8:])
            if largest > 0:  # (attach: the hooks unscaled the grads; no oracle there)
                margin = 2.0**_predictive.MARGIN_LOG2
                budget = float(torch.tensor(65504.0 / margin, dtype=torch.float32))
                expected.append(math.ldexp(1.0, math.frexp(budget / largest)[1] - 1))
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    finally:
        agreement.all_reduce_flag = real
    return {
        "scales": scales,
        "targets": expected,
        "sizes": sizes,
        "measured": scaler.snapshot()["grad_max_abs"],
        "params": full_params(model, parallel or "none"),
    }


def _telemetry_read_each_step(rank: int) -> dict[str, list[Any]]:
    """Issue 33 item 5 on ranks: rank 1 alone overflows; counters() folds the device log after
    each update and a step is followed by update(new_scale=...). Host and device paths."""
    import dscale
    from tests.scaler._setup import decide_on_device

    out: dict[str, list[Any]] = {}
    for on_device in (False, True):
        torch.manual_seed(0)
        model = tiny_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        scaler = dscale.GradScaler("cpu", policy="predictive", init_scale=2.0**10)
        if on_device:
            decide_on_device(scaler)
        trace: list[Any] = []
        for step in range(6):
            opt.zero_grad()
            scaler.scale(model(batch(rank, step)).square().mean()).backward()
            if rank == 1 and step in (2, 4):
                next(model.parameters()).grad.view(-1)[0] = math.inf
            scaler.step(opt)
            scaler.update(2.0**6 if step == 3 else None)
            counters = {k: v.item() for k, v in scaler.counters().items()}
            snap = scaler.snapshot()
            trace.append((counters["skipped_in_a_row"], repr(snap["grad_max_abs"])))
        out["device" if on_device else "host"] = trace
    return out


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "telemetry": _telemetry_read_each_step(rank),
        "plain": _train(rank, None, attach=False, reduce=True),
        "plain/no-reduce": _train(rank, None, attach=False, reduce=False),
        "ddp": _train(rank, "ddp", attach=False, reduce=True),
        "ddp/attach": _train(rank, "ddp", attach=True, reduce=True),
        "fsdp2/attach": _train(rank, "fsdp2", attach=True, reduce=True),
        "ddp/abandon": _train(rank, "ddp", attach=False, reduce=True, abandon=True),
        "ddp/attach/abandon": _train(rank, "ddp", attach=True, reduce=True, abandon=True),
    }


def test_every_rank_sets_the_same_scale_from_the_largest_magnitude_over_ranks() -> None:
    out = run_ranks(_scenarios, timeout_s=120.0)
    r0, r1 = out[0], out[1]

    # Different grads per rank (no DDP): one collective per step, the 5-field vector (3 fields
    # between the scale range's iterations), and both ranks move to the scale the oracle
    # computes from the max over ranks.
    a, b = r0["plain"], r1["plain"]
    assert a["sizes"] == b["sizes"] == [5, 3, 3, 3, 3]
    assert a["scales"] == b["scales"]
    assert a["targets"] == b["targets"]
    assert a["scales"][0] == a["targets"][0]  # the first measured step jumps to the target
    assert a["measured"] == b["measured"] > 0

    # Negative control: without the all-reduce, rank 1 (16x larger grads) picks a lower scale.
    c, d = r0["plain/no-reduce"], r1["plain/no-reduce"]
    assert c["scales"][0] >= 8 * d["scales"][0]  # 16x the grads: 8x or 16x (power-of-two steps)

    # DDP, with and without attach(): the hook measures the reduced bucket, the same values.
    e, f = r0["ddp"], r1["ddp"]
    g, h = r0["ddp/attach"], r1["ddp/attach"]
    assert e["scales"] == f["scales"] == g["scales"] == h["scales"]
    assert e["scales"][0] == e["targets"][0]
    assert torch.equal(e["params"], g["params"])
    # DDP's reduction made the hook's flag global, but the step checks the hooked grads again (a
    # write through .data may be on one rank only), so the agreement runs as without attach().
    assert g["sizes"] == e["sizes"] == [5, 3, 3, 3, 3]
    # FSDP2 with attach(): the reduce-scatter output is measured in the hook; ranks agree.
    # An abandoned backward (no step) leaves nothing for the next step with attach(): the same
    # scales and weights as without it (the oracle), on both ranks.
    k, m = r0["ddp/abandon"], r0["ddp/attach/abandon"]
    assert k["scales"] == m["scales"] == r1["ddp/attach/abandon"]["scales"]
    assert torch.equal(k["params"], m["params"])
    # grad_max_abs after counters() folded the log (the metrics log's order), on both paths:
    # NaN on every rank for rank 1's overflows (steps 2 and 4), and still step 2's after the
    # update(new_scale=...) of step 3, which runs no rule; the device path as the host path.
    for rank in (0, 1):
        host, device = out[rank]["telemetry"]["host"], out[rank]["telemetry"]["device"]
        assert device == host, rank
        assert [m == "nan" for _, m in host] == [False, False, True, True, True, False]
        assert host == out[0]["telemetry"]["host"]
    i, j = r0["fsdp2/attach"], r1["fsdp2/attach"]
    assert i["sizes"] == j["sizes"] == [5, 3, 3, 3, 3]
    assert i["scales"] == j["scales"] == e["scales"]
