"""NVFP4Seeds' refusals: at construction (every rank alike, one gather) and of a saved state.

The first-step check sends 5 slots per layer on the scaler's MAX vector, so ranks holding other
NVFP4 layers would send vectors of other lengths: gloo aborts the process on one rank ("Received
data size doesn't match expected size") and the other waits. Construction therefore compares the
ranks' layers and seeds once, and any rank's local refusal (no NVFP4 layer, a DDP that broadcasts
the SR seeds, buffers still on the meta device, layers another live NVFP4Seeds holds) is raised
on every rank. A saved state is checked whole before anything is loaded.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from dscale import _dist
from dscale.fp8._layers import LayoutMismatchError

#: The live NVFP4Seeds that set each NVFP4Linear (weakly: a closed or dropped one lets go).
owners: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def local_problem(layers: list[tuple[str, Any]], seeds: Any) -> str | None:
    """What this rank alone refuses before anything is written (None: nothing)."""
    if not layers:
        return (
            "the model holds no torchao NVFP4Linear; convert it with "
            "convert_to_float8(model, recipe='nvfp4') or build it with NVFP4Linear layers"
        )
    held = sorted({n for n, m in layers if owners.get(m) not in (None, seeds)})
    if held:
        return (
            f"the layers {held[:4]} are already set by another live NVFP4Seeds (a second one "
            "would overwrite its SR seeds, so its first-step check would refuse, and only one "
            "travels with the scaler in a checkpoint); close() the first, or keep using it"
        )
    meta = [n for n, m in layers if _is_meta(m._rht_sign_vector) or _is_meta(m._sr_seed)]
    if meta:
        return (
            f"the buffers of {meta[:4]} are on the meta device, so no sign or seed can be written "
            "(after to_empty() they would hold whatever memory held: signs of 0 zero the "
            "Hadamard transform); materialize the model first (to_empty, then init), then build "
            "NVFP4Seeds"
        )
    return None


def _is_meta(t: Any) -> bool:
    t = t.to_local() if hasattr(t, "to_local") else t
    return bool(t.device.type == "meta")


def agree(layers: list[tuple[str, Any]], seed: int, problem: str | None, group: Any) -> None:
    """One gather: raise the same error on every rank if any rank refuses or the ranks' NVFP4
    layers (names, shapes) or seeds differ; nothing is written before this passes."""
    mine = {
        "layers": [(n, m.in_features, m.out_features) for n, m in layers],
        "seed": seed,
        "problem": problem,
    }
    everyone = _dist.all_gather_objects(mine, group)
    refused = [(r, v["problem"]) for r, v in enumerate(everyone) if v["problem"] is not None]
    if refused:
        if len({p for _, p in refused}) == 1 and len(refused) == len(everyone):
            raise ValueError(f"NVFP4Seeds: {refused[0][1]}")
        raise ValueError(
            "NVFP4Seeds refused on rank(s) " + "; ".join(f"rank {r}: {p}" for r, p in refused)
        )
    if any(v["layers"] != everyone[0]["layers"] for v in everyone):
        common = set.intersection(*(set(v["layers"]) for v in everyone))
        detail = "; ".join(
            f"rank {r}: {len(v['layers'])} layers, only here: "
            f"{sorted(f'{n} ({i}->{o})' for n, i, o in set(v['layers']) - common) or 'none'}"
            for r, v in enumerate(everyone)
        )
        raise LayoutMismatchError(
            f"NVFP4Seeds: ranks hold different NVFP4 layers ({detail}); their signs are checked "
            "layer by layer on one vector: convert the same layers on every rank (the same "
            "model, the same keep_high_precision)"
        )
    seeds = [v["seed"] for v in everyone]
    if len(set(seeds)) > 1:
        raise ValueError(
            f"NVFP4Seeds: ranks passed different seeds ({seeds} by rank), so their Hadamard "
            "signs would differ; pass the same seed on every rank (the rank is mixed into the "
            "stochastic-rounding seeds already)"
        )


def check_state(state: Mapping[str, Any], saved: list[str]) -> None:
    """ValueError unless the signs, the seed and every SR-seed row of ``state`` are whole:
    one row of 16 signs, each -1 or +1, and one int64 seed per saved layer."""
    signs = state["sign_vectors"]
    if not isinstance(signs, torch.Tensor) or tuple(signs.shape) != (len(saved), 16):
        shape = tuple(signs.shape) if isinstance(signs, torch.Tensor) else type(signs).__name__
        raise ValueError(
            f"NVFP4Seeds state's sign_vectors is {shape}, not ({len(saved)}, 16) for the "
            f"{len(saved)} saved layers; the checkpoint is damaged or of another object"
        )
    bad = [n for n, row in zip(saved, signs.tolist()) if any(s not in (-1, 1) for s in row)]
    if bad:
        raise ValueError(
            f"NVFP4Seeds state's sign vectors of {bad[:4]} hold values other than -1 and +1 "
            "(a Hadamard sign of 0 zeroes the transform); the checkpoint is damaged"
        )
    seed = state["seed"]
    if not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.is_floating_point():
        raise ValueError(f"NVFP4Seeds state's seed is {seed!r}, not one int; damaged checkpoint")
    rows = state["sr_seeds"]
    if not isinstance(rows, Mapping):
        raise ValueError("NVFP4Seeds state's sr_seeds is not a table of rank_<r> rows")
    for key, row in rows.items():
        ok = isinstance(row, torch.Tensor) and row.dtype == torch.int64
        if not (ok and key.startswith("rank_") and tuple(row.shape) == (len(saved),)):
            shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
            raise ValueError(
                f"NVFP4Seeds state's sr_seeds.{key} is {shape}, not {len(saved)} int64 seeds "
                "(one per saved layer); the checkpoint is damaged"
            )
