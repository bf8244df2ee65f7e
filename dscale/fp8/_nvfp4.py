"""NVFP4Seeds: the NVFP4 layers' signs and SR seeds checked across ranks and checkpointed.

The derivation and the writing of the buffers are :mod:`dscale.fp8._nvfp4_prepare` (local, also
used by ``convert_to_float8``); here :class:`NVFP4Seeds` checks at the first step, through the
scaler's one collective, that every rank's signs agree and that no rank's SR seeds were
overwritten, and carries the per-rank SR seeds through ``dscale.checkpoint`` (key
``fp8_nvfp4``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dscale import _dist
from dscale.fp8 import _attached, _layers, _nvfp4_checks
from dscale.fp8._layers import LayoutMismatchError
from dscale.fp8._nvfp4_prepare import (
    SIGNS,
    nvfp4_layers,
    prepare,
    process_rank,
    refuse_broadcasting_ddp,
    sr_seed,
    write_buffers,
)

logger = logging.getLogger(__name__)

#: Slots per layer on the first step's agreement vector: the signs the kernels use (as a 16-bit
#: number) and its negation, the buffer's signs and negation, and "this rank's SR seed changed".
_SLOTS = 5
#: Added to :func:`_bits` when a sign is neither -1 nor +1 (memory never written: a layer built
#: on the meta device and materialized with ``to_empty()``); MAX keeps it above every valid value.
_INVALID = 1 << SIGNS


def _bits(signs: Sequence[int]) -> int:
    """Signs as a 16-bit number (exact in float32: it rides the agreement vector as it is),
    plus :data:`_INVALID` when any is neither -1 nor +1."""
    invalid = _INVALID if any(int(s) not in (-1, 1) for s in signs) else 0
    return invalid + sum(1 << i for i, s in enumerate(signs) if int(s) > 0)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor under TP


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
            write_buffers(layer, layer.rht_sign_vector, self._expected[name])
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
            write_buffers(module, signs[name], own[name])
        self._pending = True

    def close(self) -> None:
        """Stop checking and saving (the layers keep their signs and seeds)."""
        self._unfield()
        self._unhook()
        _attached.detach(self._scaler, self)
        for module in self._modules:
            if _nvfp4_checks.owners.get(module) is self:
                del _nvfp4_checks.owners[module]
