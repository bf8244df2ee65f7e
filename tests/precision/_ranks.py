"""Rank functions for tests/precision: one 2-rank spawn checks every multi-rank scenario."""

from __future__ import annotations

import copy
from typing import Any

import torch

import dscale
from dscale.fp8 import LayoutMismatchError
from dscale.precision import PrecisionSchedule
from tests.fp8 import _models

INITIAL = {
    "blocks.0.fc1": "tensorwise",
    "blocks.0.fc2": "mxfp8",
    "blocks.1.fc1": "rowwise",
    "blocks.1.fc2": "tensorwise",
}
#: From step 3 on (after a skip at step 2, injected on rank 1 only).
SWITCHES = {
    3: {"blocks.0.fc1": "bf16_forward", "blocks.0.fc2": "bf16", "blocks.1.fc1": "mxfp8"},
    4: {"blocks.1.fc2": "bf16"},
}
STEPS = 6
SKIP_AT = 2


def _build(rank: int, switches: Any = None, check_every: int = 1) -> tuple[Any, ...]:
    model = _models.net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**8)
    sched = PrecisionSchedule(
        model,
        scaler,
        initial=INITIAL,
        switches=SWITCHES if switches is None else switches,
        emulate=True,
        check_every=check_every,
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, opt, scaler, sched


def _steps(run: tuple[Any, ...], rank: int, steps: range) -> list[Any]:
    ddp, opt, scaler, sched = run
    out = []
    for step in steps:
        tokens, target = _models.batch(step, rank, size=4)  # 4 x 16 tokens: MXFP8's blocks
        loss = _models.loss_of(ddp, tokens, target)
        scaler.scale(loss).backward()
        if step == SKIP_AT and rank == 1:
            next(ddp.parameters()).grad.view(-1)[0] = float("inf")  # this rank only
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((loss.item(), scaler.step_applied(opt), sched.step, dict(sched.formats)))
    return out


def _params(run: tuple[Any, ...]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run[0].parameters()]


def _resumed_through_checkpoint(rank: int, tmp: str, at: int, whole: list[Any]) -> bool:
    from dscale.checkpoint import CheckpointManager, load_checkpoint

    first = _build(rank)
    assert _steps(first, rank, range(at)) == whole[:at]
    ckpt = CheckpointManager(f"{tmp}/at{at}", every=0, keep=1)
    ckpt.save(at, model=first[0], optimizer=first[1], scaler=first[2])  # the schedule travels
    ckpt.wait()
    first[3].close()
    resumed = _build(rank)
    step = load_checkpoint(
        f"{tmp}/at{at}/step-{at}", model=resumed[0], optimizer=resumed[1], scaler=resumed[2]
    )
    assert step == at and resumed[3].step == at and resumed[3].formats == whole[at - 1][3]
    rest = _steps(resumed, rank, range(at, STEPS))
    params = _params(resumed)
    resumed[3].close()
    return rest == whole[at:] and params  # type: ignore[return-value]


def scenarios(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    run = _build(rank)
    keep = [id(p) for p in run[0].parameters()]
    state0 = copy.deepcopy(run[1].state_dict())
    whole = _steps(run, rank, range(STEPS))
    out["whole"] = whole
    out["same_params_objects"] = keep == [id(p) for p in run[0].parameters()]
    out["params"] = _params(run)
    out["opt_state_kept"] = len(run[1].state_dict()["state"]) == len(list(run[0].parameters()))
    del state0
    run[3].close()
    # Resume before the switch (at 2: the skip and the switch still to come) and after it (4).
    for at in (2, 4):
        got = _resumed_through_checkpoint(rank, tmp, at, whole)
        out[f"resumed_at_{at}"] = got is not False and all(
            torch.equal(a, b) for a, b in zip(got, out["params"])
        )
    # A rank-local edit: rank 1 switches a layer alone; the next step refuses on every rank.
    edited = _build(rank)
    _steps(edited, rank, range(1))
    if rank == 1:
        edited[3].switch({"blocks.1.fc2": "bf16"})
    try:
        _steps(edited, rank, range(1, 2))
        out["edit"] = "not refused"
    except LayoutMismatchError as e:
        out["edit"] = str(e)
    # The same map on both ranks, but rank 1's schedule at another step (its state loaded with
    # step 3): refused at the next compared step on every rank, also with check_every=4 (where
    # the ranks used to arm the comparison at different iterations: vectors of different
    # lengths, and gloo aborted the processes).
    for every in (1, 4):
        other = _build(rank, switches={}, check_every=every)
        state = other[3].state_dict()
        if rank == 1:
            other[3].load_state_dict({**state, "step": torch.tensor(3)})
        try:
            _steps(other, rank, range(4))
            out[f"other_step_every_{every}"] = "not refused"
        except LayoutMismatchError as e:
            out[f"other_step_every_{every}"] = str(e)
        other[3].close()
    # check_every=4, switch() on rank 1 alone after iteration 0: how many iterations run with
    # the maps differing before every rank refuses (docs/block-scaled.md says up to 4).
    late = _build(rank, switches={}, check_every=4)
    _steps(late, rank, range(1))
    if rank == 1:
        late[3].switch({"blocks.1.fc2": "bf16"})
    ran = 0
    try:
        for step in range(1, 9):
            _steps(late, rank, range(step, step + 1))
            ran += 1
        out["edit_every_4"] = "not refused"
    except LayoutMismatchError as e:
        out["edit_every_4"] = (ran, str(e))
    late[3].close()
    # A layer name only rank 1 gets wrong: refused on every rank (rank 0 waited in the
    # construction's all-gather until the process group's timeout).
    try:
        PrecisionSchedule(
            _models.net(),
            dscale.GradScaler("cpu"),
            initial={"blocks.0.fc3" if rank == 1 else "blocks.0.fc1": "tensorwise"},
            emulate=True,
        )
        out["bad_name_on_rank_1"] = "not refused"
    except ValueError as e:
        out["bad_name_on_rank_1"] = str(e)
    except Exception as e:
        out["bad_name_on_rank_1"] = f"{type(e).__name__}: {e}"
    # A scaler disabled on rank 1 only: refused at construction, on every rank.
    try:
        PrecisionSchedule(
            _models.net(),
            dscale.GradScaler("cpu", enabled=rank == 0),
            initial=INITIAL,
            emulate=True,
        )
        out["disabled_on_rank_1"] = "not refused"
    except (LayoutMismatchError, ValueError) as e:
        out["disabled_on_rank_1"] = str(e)
    # A different schedule on rank 1: refused at construction, on every rank.
    try:
        _build(rank, switches={4: {"blocks.0.fc1": "bf16"}} if rank == 1 else None)
        out["other_schedule"] = "not refused"
    except LayoutMismatchError as e:
        out["other_schedule"] = str(e)
    return out
