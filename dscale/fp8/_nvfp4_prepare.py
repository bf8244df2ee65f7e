"""NVFP4 layers' buffers derived, not drawn: Hadamard signs alike on every rank, SR seeds per rank.

torchao 0.18's ``NVFP4Linear`` holds two buffers. ``_rht_sign_vector`` (16 signs, int8) is the
random Hadamard transform's basis; torchao draws it at random per module per process ("harmless
for convergence but inconsistent across checkpoints", its docstring) and its tensor-parallel path
needs it equal on every TP rank. ``_sr_seed`` (int64) keys the Philox stream of the stochastic
rounding in backward; equal seeds on every rank (DDP broadcasts buffers from rank 0, and a
checkpoint keeps one copy of a replicated buffer) correlate the rounding noise across data-parallel
ranks instead of averaging it out. The module also caches the signs as a tuple, refreshed only by
``load_state_dict``: an in-place copy into the buffer (DDP's broadcast) leaves the kernels on the
old signs.

Here the signs come from the layer's name and a seed (the same on every rank, TP ranks included,
and in every run), the SR seeds from the name, the seed and the rank (distinct per rank, the same
after a resume), both written with the tuple refreshed; the ``_sr_seed`` buffers are kept out of
DDP's buffer broadcast. Local, no collective: ``convert_to_float8`` prepares with it, and
:class:`dscale.fp8._nvfp4.NVFP4Seeds` checks the result across ranks.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dscale import _dist
from dscale.fp8 import _layers, _torchao

logger = logging.getLogger(__name__)

#: torchao's Hadamard dimension: 16 signs per sign vector.
SIGNS = 16
#: NVFP4Linear's GEMMs take M, K and N divisible by 128 (torchao's ``nvfp4_mm_triton``).
DIM_MULTIPLE = 128


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()


def sign_vector(name: str, seed: int) -> list[int]:
    """The 16 Hadamard signs of layer ``name``: the same on every rank and in every run."""
    bits = int.from_bytes(_digest("rht", seed, name)[:2], "little")
    return [1 if bits >> i & 1 else -1 for i in range(SIGNS)]


def sr_seed(name: str, seed: int, rank: int) -> int:
    """Layer ``name``'s stochastic-rounding seed on ``rank`` (int64; distinct per rank)."""
    return int.from_bytes(_digest("sr", seed, name, rank)[:8], "little", signed=True)


def process_rank() -> int:
    """This process's rank in the world; before ``init_process_group``, the launcher's ``RANK``
    (torchrun sets it), so seeds set then are still this rank's (0 without either)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return _dist.rank(None)
    return int(os.environ.get("RANK", "0"))


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor under TP


def nvfp4_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """``(name, NVFP4Linear)`` of ``model``, named as in the bare model, sorted."""
    return _layers.named_layers(model, _torchao.nvfp4_linear_class())


def refuse_broadcasting_ddp(model: nn.Module) -> None:
    """ValueError if ``model`` is a DDP that broadcasts the NVFP4 layers' SR seeds."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or not model.broadcast_buffers:
        return
    # What DDP broadcasts is the list it made at construction (buffers of layers swapped in
    # later are not in it), less its ignore list.
    listed = getattr(model, "named_module_buffers", None)
    seeds = [n for n, _ in model.module.named_buffers() if n.endswith("._sr_seed")]
    broadcast = [
        n for n in seeds if n not in model.parameters_to_ignore and (listed is None or n in listed)
    ]
    if broadcast:
        raise ValueError(
            f"the model is a DDP that broadcasts its buffers from rank 0 before every forward, "
            f"so the NVFP4 stochastic-rounding seeds {broadcast[:4]} would be rank 0's on every "
            "rank; prepare the model before wrapping it (convert_to_float8(recipe='nvfp4') or "
            "NVFP4Seeds(model, ...) on the bare model, then DDP), or pass "
            "DDP(..., broadcast_buffers=False)"
        )


def prepare(model: nn.Module, *, seed: int = 0, rank: int | None = None) -> dict[str, int]:
    """Write every NVFP4Linear's signs (from its name and ``seed``) and SR seed (and ``rank``).

    Keeps the SR seeds out of DDP's buffer broadcast (``_ddp_params_and_buffers_to_ignore``, by
    the names ``model.named_buffers()`` gives: wrap this ``model`` in DDP). Returns the SR seeds
    written, by layer name. Local: no collective.
    """
    refuse_broadcasting_ddp(model)
    rank = process_rank() if rank is None else rank
    written = {}
    for name, module in nvfp4_layers(model):
        write_buffers(module, sign_vector(name, seed), sr_seed(name, seed, rank))
        written[name] = sr_seed(name, seed, rank)
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    kinds = _torchao.nvfp4_linear_class()
    for module_name, module in model.named_modules():
        fqn = f"{module_name}._sr_seed" if module_name else "_sr_seed"
        if isinstance(module, kinds) and fqn not in ignored:
            ignored.append(fqn)
    model._ddp_params_and_buffers_to_ignore = ignored  # type: ignore[assignment]
    meta = [n for n, m in nvfp4_layers(model) if _local(m._sr_seed).device.type == "meta"]
    if meta:
        logger.warning(
            "NVFP4 layers %s are on the meta device: their Hadamard signs and SR seeds cannot "
            "be written yet (to_empty() leaves whatever memory held); build "
            "dscale.fp8.NVFP4Seeds(model, scaler) once the model is materialized",
            meta[:4],
        )
    return written


def write_buffers(
    module: Any, signs: Sequence[int] | torch.Tensor, seed: int | torch.Tensor
) -> None:
    """Set one NVFP4Linear's buffers (materialized where still on the meta device) and refresh
    the signs' tuple its forward reads (an in-place copy alone would leave it stale)."""
    device = module.weight.device
    values = torch.as_tensor(signs, dtype=torch.int8).reshape(SIGNS)
    seeds = torch.as_tensor(seed, dtype=torch.int64).reshape(1)
    for attr, value in (("_rht_sign_vector", values), ("_sr_seed", seeds)):
        buffer = getattr(module, attr)
        if _local(buffer).device.type == "meta":
            setattr(module, attr, value.to(device))
        else:
            _local(buffer).copy_(value)
    module._refresh_rht_sign_vector_tuple()


def swap_linears(model: nn.Module, names: Sequence[str]) -> None:
    """Replace each ``nn.Linear`` named in ``names`` by an NVFP4Linear holding its parameters
    (moved, not copied); its buffers are written by :func:`prepare`."""
    cls = _torchao.nvfp4_linear_class()
    modules = dict(model.named_modules())
    for name in names:
        old = modules[name]
        new = cls(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        new.weight = old.weight
        new.bias = old.bias
        new.train(old.training)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
