"""The shapes a checkpoint may declare for the scaler's and the step's entries.

The loader makes the tensors that DCP reads the scaler and train entries into from the sizes in
``.metadata`` (so that torch's scaler and dscale's load each other's entries). Those sizes are
input: a 0-d step counter declared as 0.3 GiB would be allocated before any data is read, and a
sparse data file can back the declaration with a hole. Every entry we write has a shape known
in advance (one row per saving rank, or the loading scaler's own), so anything else is refused
here, before a placeholder exists.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dscale.checkpoint._errors import CorruptCheckpointError

__all__ = ["check_declared_shapes"]

# Tensor entries of a scaler state dict (dscale/scaler/_state/: format.py, spike.py, predictive.py).
_SCALER_TENSORS = {"spike_window_values": 2, "predictive_window": 1, "predictive_memory": 1}
# A ring or window longer than the loading scaler's own is accepted up to this many values
# (policy="predictive" resizes a ring saved with another growth_interval).
_MAX_FOREIGN_VALUES = 1 << 20
_GROUPS = {
    "scaler": ("values", "per_rank", "text", "none"),
    "train": ("step", "world_size", "rng"),
}
_MAX_TEXT_BYTES = 4096  # spike_signals, hysteresis_refill, policy
_CUDA_RNG_MAX_BYTES = 1024  # torch's CUDA generator state is 16 bytes (seed, offset)


def _rng_row(name: str) -> tuple[int | None, torch.dtype | None]:
    """(exact row length or None for "at most _CUDA_RNG_MAX_BYTES", dtype) of an RNG row."""
    if name == "torch_cpu":
        return torch.get_rng_state().numel(), torch.uint8
    if name == "python":
        return len(random.getstate()[1]) + 1, torch.int64
    if name == "python_gauss":
        return 1, torch.float64
    if name == "cuda":
        return None, torch.uint8
    raise KeyError(name)


def _describe(meta: TensorStorageMetadata) -> str:
    nbytes = math.prod(meta.size) * meta.properties.dtype.itemsize
    return f"{tuple(meta.size)} {meta.properties.dtype} ({nbytes} bytes)"


def _expected(
    prefix: str, key: str, meta: TensorStorageMetadata, own: Mapping[str, Any], rows: int | None
) -> str | None:
    """What ``key`` must be, when ``meta`` is not that; None when it fits."""
    size, dtype = tuple(meta.size), meta.properties.dtype
    group, _, name = key.partition(".")
    if "." in name or group not in _GROUPS[prefix]:
        return "no entry of this name is written by dscale.checkpoint"
    per_rank = group in ("per_rank", "rng")
    if per_rank:
        if len(size) != 2 or (rows is not None and size[0] != rows):
            return f"one row per saving rank ({rows} ranks)"
        if len(meta.chunks) != size[0]:
            return f"{size[0]} rows in as many chunks, not {len(meta.chunks)}"
        if group == "per_rank":
            return None if size[1] == 1 else "one float64 per rank"
        try:
            length, want = _rng_row(name)
        except KeyError:
            return "no such RNG state: dscale saves torch_cpu, cuda, python and python_gauss"
        fits = size[1] == length if length is not None else 0 < size[1] <= _CUDA_RNG_MAX_BYTES
        return None if fits and dtype == want else f"rows of {length or '<= 1024'} {want}"
    if group in ("step", "world_size"):
        return None if size == () else "a 0-d int64 counter"
    if group == "none":
        return None if size == () else "a 0-d bool"
    if group == "text":
        fits = len(size) == 1 and size[0] <= _MAX_TEXT_BYTES and dtype == torch.uint8
        return None if fits else f"UTF-8 text, a uint8 tensor of at most {_MAX_TEXT_BYTES} bytes"
    # group == "values"
    dims = _SCALER_TENSORS.get(name, 0)
    if dims == 0:
        return None if size == () else "a 0-d number"
    value = own.get(name)
    limit = max(value.numel() if isinstance(value, torch.Tensor) else 0, _MAX_FOREIGN_VALUES)
    if isinstance(value, list):
        limit = max(len(value), _MAX_FOREIGN_VALUES)
    if len(size) == dims and math.prod(size) <= limit and dtype.itemsize <= 8:
        return None
    return f"a {dims}-d tensor of at most {limit} values"


def check_declared_shapes(
    path: Path, metadata: Metadata, prefix: str, own: Mapping[str, Any]
) -> None:
    """Raise CorruptCheckpointError unless every tensor under ``prefix`` has a shape we write.

    Args:
        path: the checkpoint folder, for the message.
        metadata: its ``.metadata``.
        prefix: "scaler" or "train".
        own: the loading scaler's state dict (bounds its windows); empty for "train".
    """
    entries = {
        fqn[len(prefix) + 1 :]: meta
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix + ".") and isinstance(meta, TensorStorageMetadata)
    }
    rows = None
    for key, meta in sorted(entries.items()):
        if key.startswith(("per_rank.", "rng.")) and len(meta.size) >= 1:
            rows = meta.size[0] if rows is None else rows
    for key, meta in sorted(entries.items()):
        problem = _expected(prefix, key, meta, own, rows)
        if problem is not None:
            raise CorruptCheckpointError(
                f"{path / '.metadata'} declares '{prefix}.{key}' as {_describe(meta)}, but "
                f"dscale.checkpoint writes it as {problem}: the sizes it declares are not the "
                "checkpoint's; nothing was allocated or loaded; restore the folder from a copy "
                "you trust, or load an earlier checkpoint"
            )
