"""attach() under every order of backward and step a user can write in one iteration.

One 2-rank spawn. Each scenario trains 4 iterations three times on the same data: with torch's
GradScaler, with dscale's without attach(), and with attach(); rank 1's loss overflows in one
backward of iteration 2. The attached run must match both bit for bit (power-of-two scale and
world size: DDP makes the grads, hence torch's decisions, the same on both ranks). Orders the hooks
cannot check are refused on every rank before anything moves. Also here: attach() does not keep
DDP's process group alive once the model and the group are gone, nor does a scaler agreeing
over that group once it is deleted.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multirank import run_ranks
from tests.scaler._setup import batch, full_params, tiny_model, wrap

POISONED_STEP = 2
GROUP_HOLDERS = ("ddp", "attach", "agree")


def _loss(model: nn.Module, x: torch.Tensor, poison: bool) -> torch.Tensor:
    loss = model(x).square().mean()
    return loss * float("inf") if poison else loss


def _scaler(kind: str, step: str = "host") -> Any:
    """``step="device"``: dscale decides fused and sync_free steps on the device, as on a GPU;
    ``"predictive"``: dscale's predictive policy (torch has none: dscale without attach() is the
    oracle)."""
    import dscale

    if kind == "torch":
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler = dscale.GradScaler(
        "cpu",
        init_scale=2.0**10,
        growth_interval=2,
        sync_free=step == "sync_free",
        policy="predictive" if step == "predictive" else "dynamic",
    )
    scaler._read_host_flags = step in ("host", "predictive")
    return scaler


def _gan(rank: int, kind: str) -> dict[str, Any]:
    """Two DDP models, two optimizers: D's backward and step, then G's (through D) and step."""
    torch.manual_seed(0)
    g_net, d_net = DDP(nn.Linear(8, 8)), DDP(tiny_model(1))
    opt_g = torch.optim.SGD(g_net.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.SGD(d_net.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(kind)
    if kind == "attach":
        scaler.attach(g_net)
        scaler.attach(d_net)
    params, scales = [], []
    for step in range(4):
        z, real = batch(rank, 10 * step), batch(rank, 10 * step + 1)
        opt_d.zero_grad()
        with torch.no_grad():
            fake = g_net(z)
        scaler.scale(d_net(torch.cat([real, fake])).square().mean()).backward()
        scaler.step(opt_d)
        opt_g.zero_grad()
        poison = step == POISONED_STEP and rank == 1
        scaler.scale(_loss(nn.Sequential(g_net, d_net), z, poison)).backward()
        scaler.step(opt_g)
        scaler.update()
        params.append(torch.cat([full_params(g_net, "ddp"), full_params(d_net, "ddp")]))
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales}


STEPS = {"adam_fused": "device", "sgd_sync_free": "sync_free", "sgd_predictive": "predictive"}


def _one_model(
    rank: int, kind: str, order: str, parallel: str = "ddp", how: str = "sgd"
) -> dict[str, Any]:
    """One model, one optimizer per layer; ``order`` says where the backward passes go."""
    base = tiny_model()
    model = wrap(base, parallel)
    first, second = (model.module if parallel == "ddp" else model)[0], base[2]
    if how == "adam_fused":  # fused: the flag reaches the kernel on the device
        opt_a: torch.optim.Optimizer = torch.optim.Adam(first.parameters(), lr=0.01, fused=True)
        opt_b: torch.optim.Optimizer = torch.optim.Adam(second.parameters(), lr=0.01, fused=True)
    else:
        opt_a = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(kind, STEPS.get(how, "host"))
    if kind == "attach":
        scaler.attach(model)
    params, scales = [], []
    for step in range(4):
        opt_a.zero_grad()
        opt_b.zero_grad()
        poison = step == POISONED_STEP and rank == 1
        x1, x2 = batch(rank, 10 * step), batch(rank, 10 * step + 1)
        if order == "backward_between_steps":
            scaler.scale(_loss(model, x1, False)).backward()
            scaler.step(opt_a)
            scaler.scale(_loss(model, x2, poison)).backward()
            scaler.step(opt_b)
        elif order == "backwards_before_first_step":
            scaler.scale(_loss(model, x1, False)).backward()
            scaler.scale(_loss(model, x2, poison)).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
        elif order == "forward_before_step":  # e.g. a metric on the batch before the step
            scaler.scale(_loss(model, x1, poison)).backward()
            with torch.no_grad():
                model(x2)
            scaler.step(opt_a)
            scaler.step(opt_b)
        elif order == "no_sync_accumulation":
            with model.no_sync():
                scaler.scale(_loss(model, x1, poison)).backward()
            scaler.scale(_loss(model, x2, False)).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
        else:
            raise ValueError(order)
        scaler.update()
        params.append(full_params(model, parallel))
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales}


def _two_models(rank: int, kind: str) -> dict[str, Any]:
    """Two DDP models under one scaler, each with its own backward and step."""
    a, b = DDP(tiny_model(0)), DDP(tiny_model(1))
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(kind)
    if kind == "attach":
        scaler.attach(a)
        scaler.attach(b)
    params, scales = [], []
    for step in range(4):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(_loss(a, batch(rank, 10 * step), False)).backward()
        scaler.step(opt_a)
        poison = step == POISONED_STEP and rank == 1
        scaler.scale(_loss(b, batch(rank, 10 * step + 1), poison)).backward()
        scaler.step(opt_b)
        scaler.update()
        params.append(torch.cat([full_params(a, "ddp"), full_params(b, "ddp")]))
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales}


def _flag_after_unscale(rank: int, kind: str) -> dict[str, Any]:
    """Torch-shaped code writes its own flag after unscale_() on every rank: 1 on rank 1 in
    iteration 2. Every parameter is attached, so DDP's reduction made the hooks' flag global:
    the written flag must still reach the other rank (issue 33 item 2). torch's scaler, which does
    not agree, is given the flag on both ranks: what agreeing on it means."""
    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(kind)
    if kind == "attach":
        scaler.attach(model)
    params, scales = [], []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(_loss(model, batch(rank, step), False)).backward()
        scaler.unscale_(opt)
        writes = step == POISONED_STEP and (rank == 1 or kind == "torch")
        flag = torch.tensor(1.0 if writes else 0.0)
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
        scaler.step(opt)
        scaler.update()
        params.append(full_params(model, "ddp"))
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales}


def _backward_after_unscale(rank: int) -> dict[str, Any]:
    """unscale_(), then one more backward, then step(): the agreed flag never saw that backward."""
    import dscale

    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    scaler.scale(_loss(model, batch(rank, 0), False)).backward()
    scaler.unscale_(opt)
    scaler.scale(_loss(model, batch(rank, 1), rank == 1)).backward()
    before = full_params(model, "ddp")
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        return {"error": str(exc), "moved": not torch.equal(before, full_params(model, "ddp"))}
    return {"error": None, "moved": not torch.equal(before, full_params(model, "ddp"))}


def _refused_after_unscale(rank: int) -> dict[str, Any]:
    """Rank 1 writes a grad after the reduction, then unscale_(), a collective of the user's (as
    FSDP's clip_grad_norm_ runs), step(): rank 1 refuses after joining the agreement where rank 0
    runs it, so the user's collective pairs with its own and rank 0 skips instead of hanging."""
    import dscale

    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    flag = torch.zeros(())  # every rank writes one: the step keeps its agreement collective
    scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
    scaler.scale(_loss(model, batch(rank, 0), False)).backward()
    if rank == 1:
        model.module[0].weight.grad.mul_(0.5)
    before = full_params(model, "ddp")
    error = None
    try:
        scaler.unscale_(opt)
        norm = torch.tensor([float(rank + 1)])
        dist.all_reduce(norm)  # the user's collective between unscale_() and step()
        scaler.step(opt)
        scaler.update()
    except RuntimeError as exc:
        error = str(exc)
    moved = not torch.equal(before, full_params(model, "ddp"))
    applied = None if error else scaler.step_applied(opt)
    return {"error": error, "moved": moved, "norm": float(norm), "applied": applied}


def _outside_reduction_after_unscale(rank: int, kind: str, how: str) -> dict[str, Any]:
    """unscale_(), then a backward that adds to the grads outside DDP's reduction (under
    ``no_sync()``, or through the bare module), then step(). torch's scaler (and dscale's without
    attach()) apply what the grads then hold; under attach() the hooks' rescale turned the
    unscaled grads back into scaled ones, which the flag unscale_() agreed on never saw."""
    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler(kind)
    if kind == "attach":
        scaler.attach(model)
    scaler.scale(_loss(model, batch(rank, 0), False)).backward()
    scaler.unscale_(opt)
    if how == "no_sync":
        with model.no_sync():
            scaler.scale(_loss(model, batch(rank, 1), False)).backward()
    else:
        scaler.scale(_loss(model.module, batch(rank, 1), False)).backward()
    before = full_params(model, "ddp")
    error = None
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        error = str(exc)
    scaler.update()
    return {"error": error, "moved": not torch.equal(before, full_params(model, "ddp"))}


def _outside_reduction_on_one_rank(rank: int) -> dict[str, Any]:
    """As above on rank 1 only, where the step keeps its agreement collective (a flag written on
    every rank): rank 1 refuses, and rank 0 must skip rather than wait for it."""
    import dscale

    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    flag = torch.zeros(())
    scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
    scaler.scale(_loss(model, batch(rank, 0), False)).backward()
    scaler.unscale_(opt)
    if rank == 1:
        scaler.scale(_loss(model.module, batch(rank, 1), False)).backward()
    before = full_params(model, "ddp")
    error = None
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        error = str(exc)
    scaler.update()
    return {
        "error": error,
        "moved": not torch.equal(before, full_params(model, "ddp")),
        "params": full_params(model, "ddp"),
        "scale": scaler.get_scale(),
    }


def _recovery_after_refusal(rank: int, where: str) -> dict[str, Any]:
    """Rank 1 writes a grad after the reduction in iteration 1 and is refused (in step(), or
    after ``where="unscale"``'s unscale_() at the flag's first read; ``"unscale_update"``: an
    iteration with unscale_() and no step(), so at update()) while rank 0 skips; both ranks
    catch it, call update() and go on. They must go on as one: same scale, same weights."""
    import dscale

    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler.attach(model)
    flag = torch.zeros(())  # every rank writes one: the step keeps its agreement collective
    errors: list[str | None] = []
    scales = []
    # "unscale_update" stops after iteration 1: that rank's stale state would hang the next.
    for step in range(2 if where == "unscale_update" else 4):
        opt.zero_grad()
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
        scaler.scale(_loss(model, batch(rank, step), False)).backward()
        if rank == 1 and step == 1:
            model.module[0].weight.grad.mul_(0.5)
        error = None
        try:
            if where != "step":
                scaler.unscale_(opt)
            if where != "unscale_update" or step != 1:
                scaler.step(opt)
        except RuntimeError as exc:
            error = str(exc)
        try:
            scaler.update()
        except Exception as exc:  # recorded: the test names it
            error = f"{error} / update(): {exc!r}" if error else f"update(): {exc}"
        errors.append(error)
        scales.append(scaler.get_scale())
    return {
        "errors": errors,
        "scales": scales,
        "params": full_params(model, "ddp"),
        "states_left": len(scaler._per_optimizer_states),  # update() starts the next afresh
    }


def _read_on_one_rank(rank: int, kind: str, parallel: str, read: str) -> dict[str, Any]:
    """unscale_(), ``_found_inf_per_device()`` read on rank 0 only (a log line), a collective of
    the user's (FSDP2's clip_grad_norm_, or an all-reduce), step(): the read must start no
    collective of its own, or it pairs with the peer's next one. Rank 1 overflows in iteration 1.
    ``read="check"``: ``_check_inf_per_device()`` instead, with no unscale_() (no clipping).
    """
    base = tiny_model()
    model = wrap(base, parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler("torch" if kind == "torch" else "plain")
    if kind == "attach":
        scaler.attach(model)
    norms, scales, reads = [], [], []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(_loss(model, batch(rank, step), step == 1 and rank == 1)).backward()
        if read == "found":
            scaler.unscale_(opt)
        if rank == 0:
            flags = getattr(scaler, f"_{read}_inf_per_device")(opt)
            reads.append([float(f) for f in flags.values()])
        if parallel == "fsdp2" and read == "found":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        else:
            norm = torch.tensor([float(rank + 1)])
            dist.all_reduce(norm)
        norms.append(float(norm))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {
        "norms": norms,
        "scales": scales,
        "reads": reads,
        "params": full_params(model, parallel),
    }


def _reads_on_one_rank(rank: int, world_size: int) -> dict[Any, Any]:
    return {
        (kind, parallel, read): _read_on_one_rank(rank, kind, parallel, read)
        for parallel, read in READS
        for kind in ("torch", "plain", "attach")
    }


# Not ("fsdp2", "check"): there torch's own _check_inf_per_device() on DTensor grads runs a
# collective (DTensor's found_inf handler gathers the flag), so on one rank torch's scaler hangs.
READS = (("ddp", "found"), ("fsdp2", "found"), ("ddp", "check"))


@pytest.fixture(scope="module")
def one_rank_reads() -> dict[int, Any]:
    # Its own spawn with a short collective timeout: a read that started the agreement on rank
    # 0 alone would pair it with rank 1's all-reduce and leave the ranks waiting.
    return run_ranks(_reads_on_one_rank, timeout_s=120, pg_timeout_s=20)


@pytest.mark.parametrize(("parallel", "read"), READS)
def test_a_flag_read_on_one_rank_starts_no_collective(one_rank_reads, parallel, read) -> None:
    # found: _found_inf_per_device() after unscale_(); check: _check_inf_per_device() before it.
    for rank, runs in one_rank_reads.items():
        oracle = runs[("torch", parallel, read)]
        assert oracle["scales"][1] == oracle["scales"][0] / 2  # rank 1's overflow: skip, back off
        for kind in ("plain", "attach"):
            got = runs[(kind, parallel, read)]
            assert got["scales"] == oracle["scales"], (rank, kind)
            # nan where rank 1 overflowed
            assert torch.tensor(got["norms"]).allclose(
                torch.tensor(oracle["norms"]), rtol=0, atol=0, equal_nan=True
            ), (rank, kind)
            assert got["reads"] == oracle["reads"], (rank, kind)  # this rank's flag, as torch's
            assert torch.equal(got["params"], oracle["params"]), (rank, kind)


class _PassesItself(torch.optim.Optimizer):
    """torch's older contract (apex/Transformer Engine style): ``step(grad_scaler=...)`` asks
    the scaler for the flag and the scale, and unscales and skips in its own code."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
        found = sum(f.float() for f in grad_scaler._check_inf_per_device(self).values())
        inv = grad_scaler._get_scale_async().double().reciprocal().float()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(torch.where(found > 0, p, p - 0.1 * p.grad * inv))


def _grad_scaler_step_after_unscale_and_backward(rank: int, kind: str) -> dict[str, Any]:
    """unscale_(), a backward whose loss overflows on rank 1, then a step(grad_scaler=...)
    optimizer: torch's scaler checks again in _check_inf_per_device() and skips; under attach()
    the flag unscale_() agreed on never saw that backward, as for a plain step() (refused)."""
    import warnings

    model = DDP(tiny_model())
    opt = _PassesItself(model.parameters())
    scaler = _scaler(kind)
    if kind == "attach":
        scaler.attach(model)
    scaler.scale(_loss(model, batch(rank, 0), False)).backward()
    scaler.unscale_(opt)
    scaler.scale(_loss(model, batch(rank, 1), rank == 1)).backward()
    before = full_params(model, "ddp")
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's, for grad_scaler=
        try:
            scaler.step(opt)
        except RuntimeError as exc:
            error = str(exc)
    after = full_params(model, "ddp")
    return {
        "error": error,
        "moved": not torch.equal(before, after),
        "finite": bool(after.isfinite().all()),
    }


def _refused_with_no_agreement(rank: int) -> dict[str, Any]:
    """Every parameter attached: rank 1 alone runs a second loss through the bare module, and
    step() refuses there. The step's agreement collective runs under attach() too (it checks the
    hooked grads again), so rank 1 joins it marked overflowed and rank 0 skips; before, no
    collective ran, rank 0 applied and rank 1's update() raised a bare AssertionError. Both go
    on as one into the next iteration."""
    import dscale

    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    errors: list[str | None] = []
    for step in range(2):
        opt.zero_grad()
        scaler.scale(_loss(model, batch(rank, step), False)).backward()
        if rank == 1 and step == 0:
            scaler.scale(_loss(model.module, batch(rank, 9), False)).backward()
        error = None
        try:
            scaler.step(opt)
        except RuntimeError as exc:
            error = f"step(): {exc}"
        try:
            scaler.update()
        except Exception as exc:  # recorded: the test names it
            error = f"{error} / update(): {type(exc).__name__}: {exc}"
        errors.append(error)
    return {
        "errors": errors,
        "applied": scaler.step_applied(opt),
        "scale": scaler.get_scale(),
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def _group_is_collected(rank: int, how: str) -> bool:
    """``del model; dist.destroy_process_group(group)``: nothing of the scaler's holds the group.

    ``how``: "ddp", the scaler agrees over the world group and DDP reduces over ``group`` (the
    control); "attach", the same with attach(); "agree", the scaler agrees over ``group`` itself
    and is deleted too (it holds its ``process_group`` argument; dscale's module-level cache of
    the group's flag device held it on main, so its gloo threads outlived destroy_process_group()
    until the interpreter's teardown, where they could abort the process at exit).
    """
    import dscale

    group = dist.new_group([0, 1])
    base = tiny_model()
    model = DDP(base, process_group=group)
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    over = group if how == "agree" else None
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, process_group=over)
    if how == "attach":
        scaler.attach(model)
    scaler.scale(_loss(model, batch(rank, 0), False)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**10  # a step was taken over the group
    gone = weakref.ref(group)
    del model
    if how == "agree":
        del scaler, over
    dist.destroy_process_group(group)
    del group
    gc.collect()
    # The plain module (whose parameters carry the hooks) is still alive, and the scaler but in
    # "agree".
    assert base is not None
    return gone() is None


def _grads_kept(rank: int, parallel: str) -> dict[str, Any]:
    """Whether the scaler keeps grads alive that the user dropped (zero_grad), and whether the
    steps took the hooks' fast check (no per-parameter classify).

    The hooks hold the grads of the last backward for step()'s identity check until update(),
    the model's next forward or its next backward; a backward abandoned without step() must not
    keep them through the next forward.
    """
    import dscale
    from dscale.scaler._attach.hooks import HookState

    if parallel == "ddp_bucket_view":  # step() reads one version per bucket
        model = DDP(tiny_model(), gradient_as_bucket_view=True)
    else:
        model = wrap(tiny_model(), parallel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    classified = []
    classify = HookState.classify

    def counting(self: Any, grads_of: Any) -> Any:
        classified.append(1)
        return classify(self, grads_of)

    def alive() -> bool:
        refs = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        assert refs, "no grads made"
        opt.zero_grad(set_to_none=True)
        return any(ref() is not None for ref in refs)

    HookState.classify = counting  # type: ignore[method-assign]
    try:
        out: dict[str, Any] = {}
        for step in range(2):
            scaler.scale(_loss(model, batch(rank, step), False)).backward()
            scaler.step(opt)
            scaler.update()
        out["after_update"] = alive()
        out["classified_in_plain_steps"] = len(classified)
        scaler.scale(_loss(model, batch(rank, 2), False)).backward()  # abandoned: no step
        refs = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch(rank, 3), False)  # the next forward
        out["at_next_forward"] = any(ref() is not None for ref in refs)
        scaler.scale(loss).backward()
        with torch.no_grad():
            model(batch(rank, 4))  # a forward between backward and step: the full check
        scaler.step(opt)
        scaler.update()
        out["classified_after_a_forward"] = len(classified) - out["classified_in_plain_steps"]
        out["applied"] = scaler.step_applied(opt)
    finally:
        HookState.classify = classify  # type: ignore[method-assign]
    return out


ORDERS = (
    "backward_between_steps",
    "backwards_before_first_step",
    "no_sync_accumulation",
    "forward_before_step",
)
RUNS: tuple[str, ...] = (
    "gan",
    "two_models",
    *(f"{order}/ddp" for order in ORDERS),
    "backward_between_steps/fsdp2",
    "backwards_before_first_step/fsdp2",
    "backward_between_steps/ddp/adam_fused",
    "backward_between_steps/ddp/sgd_sync_free",
    "backward_between_steps/ddp/sgd_predictive",
)


def _param_groups_change(rank: int, kind: str) -> dict[str, Any]:
    """The optimizer gains parameters the model does not hold, after steps made with attach():
    a group (iteration 2), then one appended to a group's list (iteration 3). Rank 1's grads of
    the new parameters overflow; the model's do not."""
    torch.manual_seed(0)
    model, extra = DDP(tiny_model()), nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(kind)
    if kind == "attach":
        scaler.attach(model)
    params, scales = [], []
    for step in range(4):
        if step == 2:
            optimizer.add_param_group({"params": [extra.weight]})
        if step == 3:
            optimizer.param_groups[0]["params"].append(extra.bias)
        optimizer.zero_grad()
        x = batch(rank, step)
        loss = _loss(model, x, False)
        if step >= 2:
            loss = loss + _loss(extra, x, rank == 1)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        params.append(torch.cat([full_params(model, "ddp"), extra.weight.flatten(), extra.bias]))
        scales.append(scaler.get_scale())
    return {"params": params, "scales": scales}


def _run(rank: int, case: str, kind: str) -> dict[str, Any]:
    if case == "gan":
        return _gan(rank, kind)
    if case == "two_models":
        return _two_models(rank, kind)
    return _one_model(rank, kind, *case.split("/"))


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in RUNS:
        kinds = ("plain", "attach") if "predictive" in case else ("torch", "plain", "attach")
        runs = {kind: _run(rank, case, kind) for kind in kinds}
        attached = runs["attach"]["params"]
        out[case] = {
            "scales": {kind: run["scales"] for kind, run in runs.items()},
            "equal_per_step": {
                kind: [torch.equal(a, b) for a, b in zip(attached, run["params"], strict=True)]
                for kind, run in runs.items()
            },
            "finite": bool(attached[-1].isfinite().all()),
            "final": attached[-1],
        }
    out["flag_after_unscale"] = {
        kind: _flag_after_unscale(rank, kind) for kind in ("torch", "plain", "attach")
    }
    out["backward_after_unscale"] = _backward_after_unscale(rank)
    out["refused_after_unscale"] = _refused_after_unscale(rank)
    out["outside_reduction_after_unscale"] = {
        (kind, how): _outside_reduction_after_unscale(rank, kind, how)
        for kind in ("torch", "plain", "attach")
        for how in ("no_sync", "bare")
    }
    out["outside_reduction_on_one_rank"] = _outside_reduction_on_one_rank(rank)
    out["grad_scaler_step"] = {
        kind: _grad_scaler_step_after_unscale_and_backward(rank, kind)
        for kind in ("torch", "attach")
    }
    out["refused_with_no_agreement"] = _refused_with_no_agreement(rank)
    out["recovery"] = {
        w: _recovery_after_refusal(rank, w) for w in ("step", "unscale", "unscale_update")
    }
    out["group_collected"] = {how: _group_is_collected(rank, how) for how in GROUP_HOLDERS}
    out["grads_kept"] = {
        parallel: _grads_kept(rank, parallel) for parallel in ("ddp", "ddp_bucket_view", "fsdp2")
    }
    out["param_groups_change"] = {
        kind: _param_groups_change(rank, kind) for kind in ("torch", "plain", "attach")
    }
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return run_ranks(_all, timeout_s=240)


@pytest.mark.parametrize("case", RUNS)
def test_every_step_of_an_iteration_is_checked_as_without_attach(results, case) -> None:
    for rank, out in results.items():
        got = out[case]
        assert got["finite"], (case, rank, "attach() applied an overflowed step")
        assert got["scales"]["attach"] == got["scales"]["plain"], got
        assert got["equal_per_step"]["plain"] == [True] * 4, (case, rank)
        if "torch" in got["scales"]:  # predictive: dscale without attach() is the oracle
            # Rank 1's overflow skips the overflowed step and backs off on both ranks.
            assert got["scales"]["torch"][POISONED_STEP] == got["scales"]["torch"][1] / 2, got
            assert got["scales"]["attach"] == got["scales"]["torch"], got
            assert got["equal_per_step"]["torch"] == [True] * 4, (case, rank)
    assert torch.equal(results[0][case]["final"], results[1][case]["final"])


def test_a_flag_written_after_unscale_on_one_rank_skips_every_rank_as_torch(results) -> None:
    for rank, out in results.items():
        oracle = out["flag_after_unscale"]["torch"]
        assert oracle["scales"][POISONED_STEP] == oracle["scales"][1] / 2  # skipped, backed off
        for kind in ("plain", "attach"):
            got = out["flag_after_unscale"][kind]
            assert got["scales"] == oracle["scales"], (rank, kind)
            for a, b in zip(got["params"], oracle["params"], strict=True):
                assert torch.equal(a, b), (rank, kind)


def test_a_backward_between_unscale_and_step_is_refused_on_every_rank(results) -> None:
    for out in results.values():
        got = out["backward_after_unscale"]
        assert got["error"] is not None and "unscale_(optimizer) after the last" in got["error"]
        assert not got["moved"]


def test_a_refusal_after_unscale_joins_the_agreement_after_the_users_collectives(results) -> None:
    r0, r1 = results[0]["refused_after_unscale"], results[1]["refused_after_unscale"]
    assert r1["error"] is not None and "attach()" in r1["error"] and not r1["moved"]
    assert r0["error"] is None and r0["applied"] is False and not r0["moved"]
    assert r0["norm"] == r1["norm"] == 3.0  # the user's all-reduce paired with its own


def test_neither_attach_nor_the_agreement_keeps_a_destroyed_process_group_alive(results) -> None:
    for out in results.values():
        # Without attach() the group goes (the control); with it, or agreed over, it must go too.
        assert out["group_collected"] == dict.fromkeys(GROUP_HOLDERS, True)


@pytest.mark.parametrize("parallel", ["ddp", "ddp_bucket_view", "fsdp2"])
def test_attach_keeps_no_dropped_grad_alive_after_update_or_at_the_next_forward(
    results, parallel
) -> None:
    for out in results.values():
        got = out["grads_kept"][parallel]
        if parallel != "ddp_bucket_view":  # there DDP's buckets keep the grads (views) anyway
            assert not got["after_update"], got
            assert not got["at_next_forward"], got  # a backward abandoned without step()
        # The held grads make the check one C-level pass; after a forward, the full one runs.
        assert got["classified_in_plain_steps"] == 0, got
        assert got["classified_after_a_forward"] == 1, got
        assert got["applied"], got


@pytest.mark.parametrize("how", ["no_sync", "bare"])
def test_a_backward_outside_the_reduction_between_unscale_and_step_is_refused(results, how) -> None:
    for out in results.values():
        runs = out["outside_reduction_after_unscale"]
        # The control: torch's scaler and dscale's without attach() apply a step here.
        assert runs[("torch", how)]["moved"] and runs[("plain", how)]["moved"]
        got = runs[("attach", how)]
        assert got["error"] is not None and "unscale_(optimizer) after the last" in got["error"]
        assert not got["moved"], "attach() applied grads the flag never saw"


def test_a_backward_outside_the_reduction_on_one_rank_skips_the_peers(results) -> None:
    r0, r1 = (
        results[0]["outside_reduction_on_one_rank"],
        results[1]["outside_reduction_on_one_rank"],
    )
    assert r1["error"] is not None and "attach()" in r1["error"] and not r1["moved"]
    assert r0["error"] is None and not r0["moved"]  # skipped with rank 1, not applied alone
    assert r0["scale"] == r1["scale"] == 2.0**9
    assert torch.equal(r0["params"], r1["params"])


@pytest.mark.parametrize("where", ["step", "unscale", "unscale_update"])
def test_ranks_go_on_as_one_after_a_refusal_on_one_rank(results, where) -> None:
    r0, r1 = results[0]["recovery"][where], results[1]["recovery"][where]
    n = len(r0["errors"])
    assert r0["errors"] == [None] * n, r0["errors"]
    refusal = r1["errors"][1]
    assert refusal is not None and "written after" in refusal
    if where == "unscale_update":  # found at the flag's first read: update()
        assert refusal.startswith("update(): attach()"), refusal
    else:
        assert "update()" not in refusal, refusal
    assert r1["errors"][:1] + r1["errors"][2:] == [None] * (n - 1), r1["errors"]
    assert r0["states_left"] == r1["states_left"] == 0
    # Rank 0 (the oracle: it saw nothing wrong) skipped iteration 1 and backed off.
    assert r0["scales"][1] == r0["scales"][0] / 2
    assert r1["scales"] == r0["scales"]
    assert torch.equal(r0["params"], r1["params"])


def test_a_backward_between_unscale_and_a_grad_scaler_step_is_refused_as_for_step(results) -> None:
    for out in results.values():
        oracle, got = out["grad_scaler_step"]["torch"], out["grad_scaler_step"]["attach"]
        assert oracle["error"] is None and not oracle["moved"]  # torch checked again: skipped
        assert got["error"] is not None and "unscale_(optimizer) after the last" in got["error"]
        assert not got["moved"] and got["finite"]


def test_a_refusal_on_one_rank_with_every_parameter_attached_skips_the_peers(results) -> None:
    r0, r1 = results[0]["refused_with_no_agreement"], results[1]["refused_with_no_agreement"]
    assert r0["errors"] == [None, None] and r0["applied"]  # rank 0 skipped step 0, applied 1
    first, second = r1["errors"]
    assert first is not None and first.startswith("step(): attach()"), first
    assert "update()" not in first, first  # rank 1's update() backs off as rank 0's does
    assert second is None and r1["applied"]  # the next iteration runs as usual
    assert r0["scale"] == r1["scale"] == 2.0**9  # one back-off on both ranks
    assert torch.equal(r0["params"], r1["params"])


def test_parameters_added_to_the_optimizer_after_attached_steps_are_checked(results) -> None:
    # attach() keeps what it knows of an optimizer's parameters between steps: a group added, or
    # a parameter appended to a group's list, must be seen. Rank 1's new grads overflow; dscale
    # without attach() is the oracle (torch skips on rank 1 only, its ranks part ways).
    for rank, out in results.items():
        got = out["param_groups_change"]
        if rank == 1:  # torch finds rank 1's overflow there only
            assert got["torch"]["scales"][2] == got["torch"]["scales"][1] / 2
        assert got["attach"]["scales"] == got["plain"]["scales"], (rank, got)
        assert got["plain"]["scales"][2] == got["plain"]["scales"][1] / 2  # both ranks skip
        assert got["plain"]["scales"][3] == got["plain"]["scales"][2] / 2
        for a, b in zip(got["attach"]["params"], got["plain"]["params"], strict=True):
            assert torch.equal(a, b), rank
    assert torch.equal(
        results[0]["param_groups_change"]["attach"]["params"][-1],
        results[1]["param_groups_change"]["attach"]["params"][-1],
    )
