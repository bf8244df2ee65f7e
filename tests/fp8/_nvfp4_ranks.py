"""Rank functions for the NVFP4 readiness tests (one spawn, every scenario).

torchao's NVFP4Linear trains on Triton kernels only, so here each layer's forward is replaced by
``F.linear`` that records what the kernels would read: the cached Hadamard signs
(``rht_sign_vector``) and the ``_sr_seed`` buffer. Construction, buffers, DDP's broadcast, the
scaler's collective and dscale.checkpoint are the real ones.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dscale
import dscale.fp8 as fp8
from dscale.checkpoint import CheckpointManager, load_checkpoint
from dscale.fp8 import _nvfp4_prepare, _torchao
from dscale.scaler._program import agreement as _agreement


def _kernel_double(model: nn.Module) -> None:
    for _, module in _nvfp4_prepare.nvfp4_layers(model):
        module.forward = lambda x, m=module: _recorded(m, x)


def _recorded(module: Any, x: torch.Tensor) -> torch.Tensor:
    module.used = (module.rht_sign_vector, int(module._sr_seed))
    return F.linear(x, module.weight, module.bias)


def _bare(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # a launcher that seeds each rank by its rank
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128, bias=False))


def _converted(rank: int) -> nn.Module:
    model = _bare(rank)
    fp8.convert_to_float8(model, recipe="nvfp4")
    _kernel_double(model)
    return model


def _used(model: nn.Module) -> dict[str, Any]:
    return {n: m.used for n, m in _nvfp4_prepare.nvfp4_layers(model)}


def _buffers(model: nn.Module) -> dict[str, Any]:
    return {
        n: (tuple(m._rht_sign_vector.tolist()), int(m._sr_seed))
        for n, m in _nvfp4_prepare.nvfp4_layers(model)
    }


def _step(model: nn.Module, opt: Any, guard: Any, rank: int) -> bool:
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(rank))
    guard.scale(model(x).square().mean()).backward()
    guard.step(opt)
    guard.update()
    opt.zero_grad()
    return guard.step_applied(opt)


def _error(fn: Any) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _torchao_alone_under_ddp(rank: int) -> dict[str, Any]:
    """The oracle of what goes wrong: torchao's own layers, each rank's draw, then DDP."""
    nvfp4_linear = _torchao.nvfp4_linear_class()
    torch.manual_seed(rank)
    model = nn.Sequential(nvfp4_linear(128, 128, bias=True), nn.ReLU(), nvfp4_linear(128, 128))
    _kernel_double(model)
    drawn = _buffers(model)
    ddp = DDP(model)
    ddp(torch.ones(8, 128)).sum().backward()
    return {"drawn": drawn, "buffers": _buffers(model), "used": _used(model)}


def _prepared_under_ddp(rank: int) -> dict[str, Any]:
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    calls = []
    original = _agreement.all_reduce_flag
    _agreement.all_reduce_flag = lambda v, g: (calls.append(v.numel()), original(v, g))[1]
    try:
        applied = [_step(ddp, opt, guard, rank) for _ in range(2)]
    finally:
        _agreement.all_reduce_flag = original
    out = {"applied": applied, "calls": calls, "used": _used(model), "buffers": _buffers(model)}
    seeds.close()
    # Converted, then wrapped, then NVFP4Seeds on the DDP (the launcher's order): accepted.
    inner = _converted(rank)
    wrapped = DDP(inner)
    guard = dscale.StepGuard("cpu")
    fp8.NVFP4Seeds(wrapped, guard)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    out["after_ddp"] = {"applied": _step(wrapped, opt, guard, rank), "used": _used(inner)}
    # Wrapped first, by a DDP that broadcasts buffers: refused on every rank.
    late = DDP(_bare(rank))
    fp8.convert_to_float8(late.module, recipe="nvfp4")
    late.module._ddp_params_and_buffers_to_ignore = []
    late = DDP(late.module)
    out["late"] = _error(lambda: fp8.NVFP4Seeds(late, dscale.StepGuard("cpu")))
    return out


def _tampered(rank: int) -> dict[str, Any]:
    """Rank 1's signs changed after NVFP4Seeds set them: layer 0 through the module's own
    refresh (its kernels use other signs), layer 2 in the buffer only (the cached tuple stale)."""
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1:
        layer0, layer2 = model[0], model[2]
        layer0._rht_sign_vector.mul_(-1)
        layer0._refresh_rht_sign_vector_tuple()
        layer2._rht_sign_vector[0] *= -1
    before = [p.detach().clone() for p in model.parameters()]
    error = _error(lambda: _step(model, opt, guard, rank))
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    seeds.close()
    return {"error": error, "unchanged": unchanged}


def _resume(rank: int, directory: str) -> dict[str, Any]:
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    fp8.NVFP4Seeds(model, guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, guard, rank)
    saved = _buffers(model)
    CheckpointManager(f"{directory}/seeds", every=0).save(
        1, model=model, optimizer=opt, scaler=guard
    )
    # Another run's values (seed=7) until the load brings the saved ones back.
    fresh = _converted(rank)
    guard2 = dscale.StepGuard("cpu")
    seeds2 = fp8.NVFP4Seeds(fresh, guard2, seed=7)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1)
    other = _buffers(fresh)
    load_checkpoint(f"{directory}/seeds/step-1", model=fresh, optimizer=opt2, scaler=guard2)
    loaded = _buffers(fresh)
    applied = _step(fresh, opt2, guard2, rank)
    out = {"saved": saved, "other": other, "loaded": loaded, "used": _used(fresh)}
    out["applied_after"] = applied
    seeds2.close()
    # What the model's state dict alone brings back (dscale.checkpoint without NVFP4Seeds).
    bare = _converted(rank)
    CheckpointManager(f"{directory}/bare", every=0).save(1, model=bare)
    fresh_bare = _converted(rank)
    with torch.no_grad():
        for _, m in _nvfp4_prepare.nvfp4_layers(fresh_bare):
            m._sr_seed.fill_(12345)
    load_checkpoint(f"{directory}/bare/step-1", model=fresh_bare)
    out["bare_saved"], out["bare_loaded"] = _buffers(bare), _buffers(fresh_bare)
    return out


def scenarios(rank: int, world: int, directory: str) -> dict[str, Any]:
    return {
        "torchao": _torchao_alone_under_ddp(rank),
        "prepared": _prepared_under_ddp(rank),
        "tampered": _tampered(rank),
        "resume": _resume(rank, directory),
        "attacks": _attacks(rank, directory),
    }


def _errors(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _widths(fn: Any) -> list[int]:
    """The length of every agreement vector all-reduced while ``fn`` runs."""
    calls: list[int] = []
    original = _agreement.all_reduce_flag
    _agreement.all_reduce_flag = lambda v, g: (calls.append(v.numel()), original(v, g))[1]
    try:
        fn()
    finally:
        _agreement.all_reduce_flag = original
    return calls


def _attacks(rank: int, directory: str) -> dict[str, Any]:
    """Review r43d: ranks that differ at construction, seeds from before init, signs that are
    not signs after a load, a DDP built before the conversion, and the slots after a load."""
    out: dict[str, Any] = {}
    # Rank 1 keeps layer 2 in high precision: other layers per rank (the first step's vector
    # would be 13 floats on rank 0 and 8 on rank 1: gloo aborts rank 1).
    model = _bare(rank)
    fp8.convert_to_float8(model, recipe="nvfp4", keep_high_precision=["2"] if rank else None)
    out["other_layers"] = _errors(lambda: fp8.NVFP4Seeds(model, dscale.StepGuard("cpu")))
    # Rank 1 holds no NVFP4 layer at all: its refusal must not be its own.
    model = _bare(rank)
    fp8.convert_to_float8(model, recipe="nvfp4", keep_high_precision=["0", "2"] if rank else None)
    out["none_on_1"] = _errors(lambda: fp8.NVFP4Seeds(model, dscale.StepGuard("cpu")))
    # Built before init_process_group (every rank is rank 0 then), stepped after.
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    initialized = torch.distributed.is_initialized
    torch.distributed.is_initialized = lambda: False
    try:
        seeds = fp8.NVFP4Seeds(model, guard)
    finally:
        torch.distributed.is_initialized = initialized
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["before_init_seeds"] = _buffers(model)
    out["before_init"] = _errors(lambda: _step(model, opt, guard, rank))
    seeds.close()
    # Every rank loads a model state whose signs are 0 (a damaged file): alike on every rank.
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = model.state_dict()
    state["0._rht_sign_vector"] = torch.zeros(16, dtype=torch.int8)
    model.load_state_dict(state)
    out["zero_signs"] = _errors(lambda: _step(model, opt, guard, rank))
    seeds.close()
    # Rank 1 alone loads another run's model state (made with seed=7's signs).
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = _converted(rank)
    fp8.NVFP4Seeds(other, dscale.StepGuard("cpu"), seed=7).close()
    if rank == 1:
        model.load_state_dict(other.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    out["other_run_on_1"] = _errors(lambda: _step(model, opt, guard, rank))
    out["other_run_unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    seeds.close()
    # torch's AMP recipe on dscale.GradScaler (two micro-batches, unscale_ + clipping on one
    # of two optimizers): the check rides the deferred collective; rank 1's signs changed.
    model = _converted(rank)
    scaler = dscale.GradScaler("cpu", init_scale=16.0)
    seeds = fp8.NVFP4Seeds(model, scaler)
    if rank == 1:
        model[0]._rht_sign_vector.mul_(-1)
        model[0]._refresh_rht_sign_vector_tuple()
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.Adam(model[2].parameters())]

    def amp_recipe() -> None:
        for micro in range(2):
            x = torch.randn(8, 128, generator=torch.Generator().manual_seed(10 * rank + micro))
            scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(opts[0])
        torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1.0)
        for opt in opts:
            scaler.step(opt)
        scaler.update()

    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler on an fp32 graph says StepGuard fits
        out["amp_recipe"] = _errors(amp_recipe)
    out["amp_unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    seeds.close()
    # A DDP built before the conversion broadcasts the buffers it listed then: not the swapped
    # layers' SR seeds, so NVFP4Seeds on it is accepted and each rank keeps its own.
    ddp = DDP(_bare(rank))
    fp8.convert_to_float8(ddp.module, recipe="nvfp4")
    _kernel_double(ddp.module)
    guard = dscale.StepGuard("cpu")
    out["ddp_before"] = _errors(lambda: fp8.NVFP4Seeds(ddp, guard))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out["ddp_before_applied"] = _step(ddp, opt, guard, rank)
    out["ddp_before_used"] = _used(ddp.module)
    # FSDP2: fully_shard neither shards nor broadcasts buffers; a resume gives each its own.
    from torch.distributed.fsdp import fully_shard

    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["fsdp_applied"] = _step(model, opt, guard, rank)
    out["fsdp_used"] = _used(model)
    CheckpointManager(f"{directory}/fsdp", every=0).save(
        1, model=model, optimizer=opt, scaler=guard
    )
    with torch.no_grad():
        for _, m in _nvfp4_prepare.nvfp4_layers(model):
            m._sr_seed.fill_(5)
    load_checkpoint(f"{directory}/fsdp/step-1", model=model, optimizer=opt, scaler=guard)
    out["fsdp_loaded"] = _buffers(model)
    seeds.close()
    # The slots ride the one collective on the first step and the first after a load only.
    model = _converted(rank)
    guard = dscale.StepGuard("cpu")
    seeds = fp8.NVFP4Seeds(model, guard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["widths"] = _widths(lambda: [_step(model, opt, guard, rank) for _ in range(2)])
    CheckpointManager(f"{directory}/widths", every=0).save(
        2, model=model, optimizer=opt, scaler=guard
    )
    load_checkpoint(f"{directory}/widths/step-2", model=model, optimizer=opt, scaler=guard)
    out["widths_after_load"] = _widths(lambda: [_step(model, opt, guard, rank) for _ in range(2)])
    seeds.close()
    return out
