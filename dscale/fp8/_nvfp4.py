"""NVFP4 readiness: Hadamard sign vectors alike on every rank, stochastic-rounding seeds per rank.

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
DDP's buffer broadcast. :class:`NVFP4Seeds` checks at the first step, through the scaler's one
collective, that every rank's signs agree and that no rank's SR seeds were overwritten, and
carries the per-rank SR seeds through ``dscale.checkpoint`` (key ``fp8_nvfp4``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dscale import _dist
from dscale.fp8 import _attached, _layers, _nvfp4_checks, _torchao
from dscale.fp8._layers import LayoutMismatchError

logger = logging.getLogger(__name__)

#: torchao's Hadamard dimension: 16 signs per sign vector.
SIGNS = 16
#: NVFP4Linear's GEMMs take M, K and N divisible by 128 (torchao's ``nvfp4_mm_triton``).
DIM_MULTIPLE = 128
#: Slots per layer on the first step's agreement vector: the signs the kernels use (as a 16-bit
#: number) and its negation, the buffer's signs and negation, and "this rank's SR seed changed".
_SLOTS = 5


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()


def sign_vector(name: str, seed: int) -> list[int]:
    """The 16 Hadamard signs of layer ``name``: the same on every rank and in every run."""
    bits = int.from_bytes(_digest("rht", seed, name)[:2], "little")
    return [1 if bits >> i & 1 else -1 for i in range(SIGNS)]


def sr_seed(name: str, seed: int, rank: int) -> int:
    """Layer ``name``'s stochastic-rounding seed on ``rank`` (int64; distinct per rank)."""
    return int.from_bytes(_digest("sr", seed, name, rank)[:8], "little", signed=True)


#: Added to :func:`_bits` when a sign is neither -1 nor +1 (memory never written: a layer built
#: on the meta device and materialized with ``to_empty()``); MAX keeps it above every valid value.
_INVALID = 1 << SIGNS


def process_rank() -> int:
    """This process's rank in the world; before ``init_process_group``, the launcher's ``RANK``
    (torchrun sets it), so seeds set then are still this rank's (0 without either)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return _dist.rank(None)
    return int(os.environ.get("RANK", "0"))


def _bits(signs: Sequence[int]) -> int:
    """Signs as a 16-bit number (exact in float32: it rides the agreement vector as it is),
    plus :data:`_INVALID` when any is neither -1 nor +1."""
    invalid = _INVALID if any(int(s) not in (-1, 1) for s in signs) else 0
    return invalid + sum(1 << i for i, s in enumerate(signs) if int(s) > 0)


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
        _write(module, sign_vector(name, seed), sr_seed(name, seed, rank))
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


def _write(module: Any, signs: Sequence[int] | torch.Tensor, seed: int | torch.Tensor) -> None:
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


class _LoadHook:
    """The model's load_state_dict post hook, calling its NVFP4Seeds; pickled or deep-copied
    with the model (``torch.save(model)``, a copy for an EMA) it becomes a no-op: a bound method
    would drag the NVFP4Seeds and its scaler along (unpicklable), and the copy's layers are not
    the ones it set (build another NVFP4Seeds on the copy)."""

    def __init__(self, seeds: NVFP4Seeds) -> None:
        self.seeds: NVFP4Seeds | None = seeds

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        if self.seeds is not None:
            self.seeds._after_model_load(module, incompatible)

    def __getstate__(self) -> dict[str, Any]:
        return {"seeds": None}


class NVFP4Seeds:
    """The NVFP4 layers' Hadamard signs and SR seeds: set, checked at the first step, saved.

    Example::

        model = build_model_with_nvfp4_linears()  # or convert_to_float8(model, recipe="nvfp4")
        scaler = dscale.StepGuard("cuda")
        seeds = dscale.fp8.NVFP4Seeds(model, scaler)  # before DDP(model)
        model = DDP(model)  # the SR seeds stay each rank's own

    Construction writes every ``NVFP4Linear``'s 16 signs from its name and ``seed`` (alike on
    every rank, TP ranks included) and its SR seed from the name, ``seed`` and the rank, and keeps
    the SR seeds out of DDP's buffer broadcast; a DDP given here that would broadcast them is
    refused. At the first step (and the first after a load) the signs each rank's kernels use,
    and whether its SR seeds are still its own, ride the scaler's one collective; if any rank
    differs, every rank raises :class:`LayoutMismatchError` naming the layers before the step.
    State (``dscale.checkpoint`` saves it with the scaler, key ``fp8_nvfp4``): ``names``,
    ``seed``, ``sign_vectors`` and ``sr_seeds.rank_<r>`` (each rank writes its own row, so each
    gets its own back; DCP would keep one copy of the model's replicated ``_sr_seed`` buffers).
    """

    def __init__(self, model: nn.Module, scaler: Any, *, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int (the same on every rank), got {seed!r}")
        self._model = model
        self._scaler = scaler
        self.seed = seed
        self.rank = process_rank()
        layers = nvfp4_layers(model)
        problem = _nvfp4_checks.local_problem(layers, self)
        if problem is None:
            try:
                refuse_broadcasting_ddp(model)
            except ValueError as exc:
                problem = str(exc)
        # One gather: a refusal, other layers or another seed on any rank raise on every rank
        # (a rank raising alone would leave the others in the first step's collective).
        group = scaler._process_group() if hasattr(scaler, "_process_group") else None
        _nvfp4_checks.agree(layers, seed, problem, group)
        self.names = tuple(n for n, _ in layers)
        self._modules = [m for _, m in layers]
        self._expected = prepare(model, seed=seed)
        for module in self._modules:
            _nvfp4_checks.owners[module] = self
        self._pending = True  # check at the next step
        self._sent = False
        self._slots: torch.Tensor | None = None
        self._unfield = scaler.add_agreement_field(self)
        _attached.attach_nvfp4(scaler, self)
        self._unhook = model.register_load_state_dict_post_hook(_LoadHook(self)).remove

    # ------------------------------------------------------------ the agreement field protocol
    def values(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """On the first step (and the first after a load): per layer the signs the kernels use
        and their negation, the buffer's and its negation, 1 if this rank's SR seed changed."""
        if not self._pending:
            return None
        self._pending, self._sent = False, True
        rank_changed = self.rank != process_rank()
        rows = []
        for name, module in zip(self.names, self._modules):
            used = _bits(module.rht_sign_vector)
            held = _bits(_local(module._rht_sign_vector).tolist())
            moved = int(_local(module._sr_seed).reshape(-1)[0]) != self._expected[name]
            # 2: the seeds were derived for another rank (built before init_process_group,
            # every rank as rank 0, so every rank's stochastic rounding alike).
            rows.append([used, -used, held, -held, 2.0 if rank_changed else float(moved)])
        return torch.tensor(rows, dtype=torch.float32).reshape(-1)

    def agreed(self, slots: torch.Tensor) -> None:
        """This field's slots in the vector the scaler all-reduces (MAX)."""
        self._slots = slots

    def verify(self) -> None:
        """After the collective, before the step: raise on every rank if any rank differs.

        Every rank holds the same agreed slots, so every rank raises the same error.
        """
        if not self._sent or self._slots is None:
            return
        self._sent = False
        rows = self._slots.detach().cpu().reshape(-1, _SLOTS).tolist()
        self._slots = None
        signs = [
            n
            for n, (hi, neg_lo, held_hi, held_neg_lo, _) in zip(self.names, rows)
            if len({hi, -neg_lo, held_hi, -held_neg_lo}) > 1
        ]
        seeds = [n for n, row in zip(self.names, rows) if 0 < row[4] < 2]
        before_init = [n for n, row in zip(self.names, rows) if row[4] >= 2]
        invalid = [n for n, row in zip(self.names, rows) if max(row[0], row[2]) >= _INVALID]
        problems = []
        if invalid:
            problems.append(
                f"the Hadamard sign vectors of {invalid} hold values other than -1 and +1 on "
                "some rank (a sign of 0 zeroes the transform): a damaged state loaded, or "
                "memory never written (a model built on the meta device, then to_empty()); "
                "load a sound state, or build NVFP4Seeds after the model is materialized"
            )
        if before_init:
            problems.append(
                f"the stochastic-rounding seeds of {before_init} were derived for another "
                "rank than this process's on some rank (NVFP4Seeds built before "
                "init_process_group: every rank as rank 0, so every rank rounds alike); build "
                "NVFP4Seeds after init_process_group"
            )
        if signs:
            problems.append(
                f"the Hadamard sign vectors of {signs} differ between ranks (or from the "
                "buffer on some rank: an in-place copy into _rht_sign_vector leaves "
                "NVFP4Linear's cached signs stale); the two GEMM operands of a layer must "
                "use one basis: write them through NVFP4Seeds (or load_state_dict), the same "
                "seed on every rank"
            )
        if seeds:
            problems.append(
                f"the stochastic-rounding seeds of {seeds} were overwritten on some rank since "
                "NVFP4Seeds set them (DDP's buffer broadcast from rank 0, FSDP1's "
                "sync_module_states, or a model load that kept one rank's copy); build "
                "NVFP4Seeds before wrapping the model, or DDP(..., broadcast_buffers=False)"
            )
        if problems:
            raise LayoutMismatchError("NVFP4Seeds: " + "; ".join(problems))

    # ------------------------------------------------------------------------------ state
    def _after_model_load(self, module: nn.Module, incompatible: Any) -> None:
        # A model state dict holds one copy of the replicated _sr_seed buffers: put each
        # rank's own back, and check again at the next step.
        for name, layer in zip(self.names, self._modules):
            _write(layer, layer.rht_sign_vector, self._expected[name])
        self._pending = True

    def state_dict(self) -> dict[str, Any]:
        """This model's layers, the signs, the seed, and this rank's SR seeds (one row)."""
        return {
            "names": torch.tensor(list("\n".join(self.names).encode()), dtype=torch.uint8),
            "seed": torch.tensor(self.seed, dtype=torch.int64),
            "sign_vectors": torch.tensor(
                [list(m.rht_sign_vector) for m in self._modules], dtype=torch.int8
            ),
            "sr_seeds": {
                f"rank_{self.rank}": torch.tensor(
                    [self._expected[n] for n in self.names], dtype=torch.int64
                )
            },
        }

    def _checked_state(self, state: Mapping[str, Any]) -> dict[str, int] | None:
        """This rank's saved SR seeds by name (None: saved by another world size); ValueError
        naming the layers when the state is of other layers. Changes nothing."""
        missing = [k for k in ("names", "seed", "sign_vectors", "sr_seeds") if k not in state]
        if missing:
            raise ValueError(f"NVFP4Seeds state lacks {missing}; is it of another object?")
        saved = bytes(state["names"].tolist()).decode().split("\n") if len(state["names"]) else []
        _layers.refuse_other_layers("NVFP4Seeds", saved, len(saved), list(self.names))
        _nvfp4_checks.check_state(state, saved)
        rows = state["sr_seeds"]
        mine = rows.get(f"rank_{self.rank}")
        if len(rows) != _dist.world_size(None) or mine is None:
            return None
        return {n: int(v) for n, v in zip(saved, mine.tolist())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the signs and this rank's SR seeds (from another world size: derived anew
        for this rank from the saved seed, with a log line); checked at the next step."""
        own = self._checked_state(state)
        saved = bytes(state["names"].tolist()).decode().split("\n")
        signs = dict(zip(saved, state["sign_vectors"].tolist()))
        self.seed = int(state["seed"])
        if own is None:
            logger.info(
                "NVFP4Seeds: the state was saved by %d ranks and this job has %d; each rank's "
                "stochastic-rounding seeds are derived anew from seed=%d",
                len(state["sr_seeds"]),
                _dist.world_size(None),
                self.seed,
            )
            own = {n: sr_seed(n, self.seed, self.rank) for n in self.names}
        self._expected = own
        for name, module in zip(self.names, self._modules):
            _write(module, signs[name], own[name])
        self._pending = True

    def close(self) -> None:
        """Stop checking and saving (the layers keep their signs and seeds)."""
        self._unfield()
        self._unhook()
        _attached.detach(self._scaler, self)
        for module in self._modules:
            if _nvfp4_checks.owners.get(module) is self:
                del _nvfp4_checks.owners[module]
