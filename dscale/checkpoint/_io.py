"""One checkpoint in, one checkpoint out: the DCP calls and the errors around them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.stateful import Stateful

from dscale.checkpoint import _comm
from dscale.checkpoint._errors import CheckpointError
from dscale.checkpoint._safe_io import SafeLoadPlanner, SafeReader, read_metadata
from dscale.checkpoint._states import ModelState, OptimizerState, ScalerState, TrainState
from dscale.checkpoint._verify import verify_checksums, verify_scaler_agreement

__all__ = ["build_states", "describe_failure", "load_checkpoint"]

logger = logging.getLogger(__name__)

_RESERVED = ("scaler", "train", "model", "optimizer")


def build_states(
    *,
    step: int,
    model: torch.nn.Module | None,
    optimizer: Any,
    scaler: Any,
    extra: Mapping[str, Any] | None,
    group: ProcessGroup | None,
    metadata: Metadata | None = None,
) -> dict[str, Any]:
    """The top-level DCP state dict; ``metadata`` is given when loading.

    The scaler comes first: DCP applies the Statefuls in this order, and the scaler's
    agreement check then runs before the model or optimizer is touched.
    """
    states: dict[str, Any] = {}
    if scaler is not None:
        states["scaler"] = ScalerState(scaler, group, metadata)
    states["train"] = TrainState(step, group, metadata)
    if model is not None:
        states["model"] = ModelState(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        if model is None:
            raise ValueError(
                "optimizer was given without model; pass model=... too, since optimizer state "
                "is stored under parameter names so that it reshards with the model"
            )
        states["optimizer"] = OptimizerState(model, optimizer)
    elif optimizer is not None:
        if not isinstance(optimizer, Stateful):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or have state_dict() and "
                f"load_state_dict() (like dscale.FP16Optimizer), got {type(optimizer).__name__}"
            )
        states["optimizer"] = optimizer
    for name, value in (extra or {}).items():
        if name in _RESERVED or "." in name:
            raise ValueError(
                f"extra has the key {name!r}, which is reserved or contains a dot; "
                f"rename it (reserved: {', '.join(_RESERVED)})"
            )
        if not isinstance(value, Stateful):
            raise TypeError(
                f"extra[{name!r}] must have state_dict() and load_state_dict(), "
                f"got {type(value).__name__}"
            )
        states[name] = value
    return states


def describe_failure(exc: CheckpointException) -> str:
    """DCP's per-rank failures as one line per distinct message."""
    messages: dict[str, list[int]] = {}
    for rank, (error, *_) in sorted(exc.failures.items()):
        messages.setdefault(f"{type(error).__name__}: {error}".strip(), []).append(rank)
    return "; ".join(f"{msg} (ranks {ranks})" for msg, ranks in messages.items())


def _flat_keys(name: str, state: Any) -> set[str]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({name: state.state_dict()})
    return set(flat)


def _check_keys(path: Path, metadata: Metadata, states: dict[str, Any]) -> None:
    """Raise CheckpointError when the checkpoint holds other entries than the model/optimizer.

    DCP ignores saved entries that the object being loaded lacks, so without this a
    checkpoint of a bigger model, or an optimizer whose state is not initialized, would load
    silently and partially.
    """
    saved = set(metadata.state_dict_metadata)
    for name in ("model", "optimizer"):
        if name not in states:
            continue
        here = _flat_keys(name, states[name])
        there = {k for k in saved if k.split(".", 1)[0] == name}
        if not there:
            raise CheckpointError(f"{path} has no {name} state; it was saved without {name}=...")
        lacking, missing = sorted(there - here), sorted(here - there)
        if lacking or missing:
            parts = []
            if missing:
                parts.append(
                    f"{len(missing)} entries are not in the checkpoint "
                    f"(e.g. {', '.join(missing[:3])})"
                )
            if lacking:
                parts.append(
                    f"{len(lacking)} saved entries have no place in the {name} "
                    f"being loaded (e.g. {', '.join(lacking[:3])})"
                )
            hint = (
                "is it a checkpoint of another model?"
                if name == "model"
                else "is the optimizer's state initialized (one step taken) and of the same kind?"
            )
            raise CheckpointError(f"{path} does not match the {name}: {'; '.join(parts)}; {hint}")


def check_folder(path: str | Path) -> Path:
    """Raise CheckpointError unless ``path`` is a folder (reads nothing inside it)."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(
            f"checkpoint path {path} is a file, not a step-N folder; for a scaler state saved "
            "with torch.save(scaler.state_dict(), path) use dscale.checkpoint.load_scaler_file"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint folder {path} does not exist; pass a step-N folder written by "
            "dscale.checkpoint, or use resume='auto' to pick the newest one"
        )
    return path


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
) -> int:
    """Load one published checkpoint folder in place and return its step.

    Order: checksums (every rank checks a share of the files), metadata (safe unpickler), key
    match, DCP load (safe planner), then the scaler agreement check across ranks.

    Raises:
        CheckpointError: missing folder, unreadable or non-matching checkpoint.
        CorruptCheckpointError: a file does not match its checksum.
        ScaleMismatchError: the ranks' scaler states differ (saved or after load).
    """
    path = check_folder(path)
    verify_checksums(path, process_group)
    metadata = read_metadata(path)
    states = build_states(
        step=0,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        extra=extra,
        group=process_group,
        metadata=metadata,
    )
    _check_keys(path, metadata, states)
    saved = metadata.state_dict_metadata
    if scaler is not None and not any(k.startswith("scaler.") for k in saved):
        logger.warning("%s holds no scaler state; the scaler keeps its current state", path)
    try:
        with _comm.quiet_single_process():
            dcp_load(
                states,
                storage_reader=SafeReader(path),
                planner=SafeLoadPlanner(),
                process_group=process_group,
                no_dist=not _comm.is_distributed(process_group),
            )
    except CheckpointException as exc:
        raise CheckpointError(f"loading {path} failed: {describe_failure(exc)}") from exc
    if scaler is not None:
        verify_scaler_agreement(scaler, process_group)
    step = int(states["train"].step)
    logger.info("loaded checkpoint %s (step %d) on rank %d", path, step, _comm.rank(process_group))
    return step
