"""attach() is as correct as the plain path, or refuses with an error that names the case.

One 2-rank spawn. Each scenario runs twice on the same data, with and without attach(), and the
attached run must match the plain one bit for bit (power-of-two scale and world size), on every
rank; the cases attach() cannot make exact must raise instead of stepping.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.amp.grad_scaler import OptState
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multirank import run_ranks
from tests.scaler._setup import batch, full_params, tiny_model


def _ddp(model: nn.Module, *, ignore: tuple[str, ...] = (), group: Any = None) -> nn.Module:
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    return DDP(model, process_group=group)


def _fsdp2(model: nn.Module, *, ignore: tuple[str, ...] = ()) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ignored = {p for n, p in model.named_parameters() if n in ignore}
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    return model


def _poison_during_backward(model: nn.Module, name: str) -> Any:
    """An inf in ``name``'s grad made by the backward itself (a write after it is refused)."""
    p = dict(model.named_parameters())[name]
    return p.register_hook(lambda g: g * float("inf"))


class _PassesItself(torch.optim.Optimizer):
    """torch's older contract (apex/Transformer Engine style): ``step(grad_scaler=...)`` divides
    by ``_get_scale_async()`` itself, asked before the check, as Transformer Engine asks."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        inv = grad_scaler._get_scale_async().double().reciprocal().float()
        found = sum(grad_scaler._check_inf_per_device(self).values())
        if float(found) == 0:
            for p in params:
                p.sub_(0.1 * p.grad * inv)


class _PassesItselfUnscaling(_PassesItself):
    """The same contract, unscaling through ``grad_scaler.unscale_(self)`` instead."""

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:
        grad_scaler.unscale_(self)
        found = sum(grad_scaler._found_inf_per_device(self).values())
        if float(found) == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    p.sub_(0.1 * p.grad)


def _idle_hooks(rank: int, attach: bool) -> dict[str, Any]:
    """An attached model with no backward this iteration, and a step(grad_scaler=...) optimizer
    over another model: one check (one observer call) per step, as without attach()."""
    import dscale

    idle, model = _ddp(tiny_model()), tiny_model()
    opt = _PassesItselfUnscaling(model.parameters())
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    seen: list[int] = []

    class Counting:
        def on_grads(self, optimizer: Any, grads: Any, scale: Any) -> None:
            seen.append(len(grads))

        def on_update(self, scaler: Any, found_inf: Any) -> None:
            pass

    scaler.add_observer(Counting())  # type: ignore[arg-type]
    if attach:
        scaler.attach(idle)
    for step in range(2):
        opt.zero_grad()
        scaler.scale(model(batch(rank, step)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    return {"params": full_params(model, "plain"), "checks": seen}


def _train(rank: int, case: str, attach: bool) -> dict[str, Any]:
    import dscale

    world = dist.get_world_size()
    base = tiny_model()
    inner = base
    if case == "ddp_subgroups":  # one DDP group per rank; the scaler agrees over the world
        groups = [dist.new_group([r]) for r in range(world)]
        model = _ddp(base, group=groups[rank])
    elif case in ("ddp_ignored", "second_loss_outside"):
        # second_loss_outside: an ignored parameter keeps the agreement collective, which then
        # also checks the grads the extra backward added (fully attached, it is refused below).
        model = _ddp(base, ignore=("2.bias",))
    elif case == "fsdp2_ignored":
        model = _fsdp2(base, ignore=("2.bias",))
    elif case.endswith("bucket_view"):  # grads are views of DDP's buckets (rebuilt once)
        model = DDP(base, gradient_as_bucket_view=True)
    else:
        model = _ddp(base)
    name = "module.2.bias" if isinstance(model, DDP) else "2.bias"
    if case == "passes_itself":
        opt: torch.optim.Optimizer = _PassesItself(model.parameters())
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    if attach:
        scaler.attach(model)
    params, scales = [], []
    for step in range(4):
        opt.zero_grad()
        poisoned = step == 2 and rank == 1 and case not in ("abandoned", "user_flag")
        handle = _poison_during_backward(model, name) if poisoned else None
        if case == "abandoned" and step == 1:
            # A batch given up after backward (its loss overflowed on rank 1): no step().
            poison = float("inf") if rank == 1 else 1.0
            scaler.scale(model(batch(rank, 50)).sum() * poison).backward()
            opt.zero_grad()
        micro = 2 if case.startswith("accumulate_synced") else 1
        for m in range(micro):  # every backward syncs: no model.no_sync()
            scaler.scale(model(batch(rank, 10 * step + m)).square().mean()).backward()
        if case == "second_loss_outside":  # a loss through the bare module: no DDP hook sees it
            scaler.scale(model.module(batch(rank, 99 + step)).mean()).backward()
        if handle is not None:
            handle.remove()
        if case == "user_flag":  # torch-shaped code's own flag, rank-local: 1 on rank 1 at step 2
            flag = torch.tensor(1.0 if (step == 2 and rank == 1) else 0.0)
            scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
        scaler.step(opt)
        scaler.update()
        params.append(full_params(model, "fsdp2" if case.startswith("fsdp2") else "ddp"))
        scales.append(scaler.get_scale())
    del inner
    return {"params": params, "scales": scales}


def _refused_on_one_rank(rank: int, policy: str, keeps: str = "ignored") -> dict[str, Any]:
    """Only rank 1 writes a grad after the reduction: it raises, rank 0 skips and does not hang.

    The step keeps an agreement collective (``keeps``): an ignored parameter, a flag written by
    torch-shaped code on every rank, or the spike gate, each with every other parameter in the
    hook. The refusing rank joins it with a vector as long as its peers' (policy="predictive"
    sends 5 fields, not 3; the spike gate its slots).
    """
    import dscale

    model = _ddp(tiny_model(), ignore=("2.bias",) if keeps == "ignored" else ())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spike = {"spike_signals": ("loss", "grad_norm")} if keeps == "spike_gate" else {}
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, policy=policy, **spike)
    scaler.attach(model)
    scaler.scale(model(batch(rank, 0)).sum()).backward()
    if keeps == "user_flag":
        flag = torch.zeros(())
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {flag.device: flag}
    if rank == 1:
        model.module[0].weight.grad.mul_(0.5)
    before = full_params(model, "ddp")
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        return {"error": str(exc), "moved": not torch.equal(before, full_params(model, "ddp"))}
    scaler.update()
    return {"error": None, "applied": scaler.step_applied(opt), "scale": scaler.get_scale()}


def _refused(rank: int, case: str) -> str:
    import dscale

    parallel = "fsdp2" if case.startswith("fsdp2") else "ddp"
    if parallel == "fsdp2":
        model = _fsdp2(tiny_model())
    elif case.endswith("bucket_view"):  # one version per bucket: a view shares its base's
        model = DDP(tiny_model(), gradient_as_bucket_view=True)
    else:
        model = _ddp(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(model)
    before = full_params(model, parallel)
    try:
        if case == "backward_without_scale":
            model(batch(rank, 0)).sum().backward()
        else:
            scaler.scale(model(batch(rank, 0)).sum()).backward()
        if case in ("grad_written_after_backward", "grad_written_after_backward_bucket_view"):
            model.module[0].weight.grad.mul_(0.5)  # e.g. a framework's after-backward hook
        elif case == "fsdp2_grad_written_after_backward":  # the local shard's version moves
            model[0].weight.grad.mul_(0.5)
        elif case == "grad_replaced_after_backward":  # a new grad: same values, same version
            weight = model.module[0].weight
            grad = weight.grad.clone()
            while grad._version < weight.grad._version:
                grad.add_(0.0)
            weight.grad = grad
        elif case == "second_loss_outside_fully_attached":
            scaler.scale(model.module(batch(rank, 1)).sum()).backward()
        elif case == "unscaled_by_torch_shaped_code":  # would divide the hooks' grads again
            grads = [p.grad for p in model.parameters()]
            found = torch.zeros(())
            inv = scaler._get_scale_async().double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            state = scaler._per_optimizer_states[id(opt)]
            state["stage"] = OptState.UNSCALED
            state["found_inf_per_device"] = {found.device: found}
        scaler.step(opt)
        scaler.update()
    except RuntimeError as exc:
        assert torch.equal(before, full_params(model, parallel)), "refused, yet params moved"
        return str(exc)
    return "no error"


CASES = (
    "accumulate_synced",
    "accumulate_synced_bucket_view",
    "second_loss_outside",
    "ddp_subgroups",
    "ddp_ignored",
    "fsdp2_ignored",
    "abandoned",
    "user_flag",
    "passes_itself",
)
REPLICATED = (
    "accumulate_synced",
    "accumulate_synced_bucket_view",
    "abandoned",
    "user_flag",
    "passes_itself",
)
REFUSED = (
    "backward_without_scale",
    "grad_written_after_backward",
    "grad_written_after_backward_bucket_view",
    "fsdp2_grad_written_after_backward",
    "grad_replaced_after_backward",
    "second_loss_outside_fully_attached",
    "unscaled_by_torch_shaped_code",
)


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        plain, attached = _train(rank, case, False), _train(rank, case, True)
        # Compared here: results stay small (a large result would have to cross a pipe).
        out[case] = {
            "equal_per_step": [
                torch.equal(a, b) for a, b in zip(attached["params"], plain["params"], strict=True)
            ],
            "scales": {"plain": plain["scales"], "attach": attached["scales"]},
            "final": attached["params"][-1],
        }
    for case in REFUSED:
        out[case] = _refused(rank, case)
    for policy in ("dynamic", "predictive"):
        out[f"refused_on_one_rank/{policy}"] = _refused_on_one_rank(rank, policy)
    plain, attached = _idle_hooks(rank, False), _idle_hooks(rank, True)
    out["idle_hooks"] = {
        "equal": torch.equal(plain["params"], attached["params"]),
        "checks": (plain["checks"], attached["checks"]),
    }
    for keeps in ("user_flag", "spike_gate"):
        out[f"refused_on_one_rank/{keeps}"] = _refused_on_one_rank(rank, "dynamic", keeps)
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return run_ranks(_all, timeout_s=240)


@pytest.mark.parametrize("case", CASES)
def test_attach_matches_the_plain_path_bit_for_bit(results, case) -> None:
    for rank, out in results.items():
        scales = out[case]["scales"]
        assert scales["attach"] == scales["plain"], (case, rank)
        assert out[case]["equal_per_step"] == [True] * 4, (case, rank)
    assert results[0][case]["scales"] == results[1][case]["scales"]
    if case in REPLICATED:  # elsewhere some parameters are rank-local by design
        assert torch.equal(results[0][case]["final"], results[1][case]["final"])


@pytest.mark.parametrize("case", REFUSED)
def test_attach_refuses_grads_it_did_not_check(results, case) -> None:
    for out in results.values():
        assert "attach()" in out[case], out[case]


@pytest.mark.parametrize(
    ("policy", "backed_off"),
    [("dynamic", 2.0**9), ("predictive", 0.5), ("user_flag", 2.0**9), ("spike_gate", 2.0**9)],
)
def test_a_refusal_on_one_rank_skips_the_step_on_the_others_instead_of_hanging(
    results, policy, backed_off
) -> None:
    key = f"refused_on_one_rank/{policy}"
    r0, r1 = results[0][key], results[1][key]
    assert "attach()" in r1["error"] and not r1["moved"]
    # predictive: the first step runs at min(init_scale, 1) = 1, and the skip backs off from it.
    assert r0 == {"error": None, "applied": False, "scale": backed_off}


def test_idle_hooks_leave_a_grad_scaler_optimizer_one_check_per_step(results) -> None:
    for out in results.values():
        plain, attached = out["idle_hooks"]["checks"]
        assert plain == attached == [4, 4], out["idle_hooks"]
        assert out["idle_hooks"]["equal"]
