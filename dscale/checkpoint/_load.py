"""Load one checkpoint: check everything, then change anything.

1. Inspect (each rank, no collective): every file is a regular file of the folder (nothing
   opened yet) without holes where values are read, the folder's format and version, the
   manifest, the metadata (safe unpickler), its declared sizes against the bytes on disk and
   against the shapes of what is loaded (model, optimizer and extras: their own tensors;
   scaler and step: the shapes dscale writes), and that the model's and optimizer's keys match.
2. Read (DCP) into empty copies of the states while each rank hashes its share of the files.
3. Check what was read: checksums, the extras that check their state (dscale.fp8's
   WeightScales: by layer name and shape), the saving ranks' scaler rows, the scaler accepting
   it, and every rank ending with the same scale.
4. Apply: model, optimizer, scaler, extras, RNG.

After each of steps 1 to 3 every rank learns every rank's result, so a problem on one rank
raises the same error on all of them (no hang), and a refused load changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from dscale import _dist
from dscale.checkpoint._errors import (
    ERROR_TYPES,
    CheckpointError,
    CorruptCheckpointError,
    ScaleMismatchError,
    describe_failure,
)
from dscale.checkpoint._expected import check_declared_shapes
from dscale.checkpoint._files import check_declared_sizes, check_listed, check_regular_files
from dscale.checkpoint._hashing import verify_share
from dscale.checkpoint._layout import check_folder, read_format, read_manifest
from dscale.checkpoint._quiet import quiet_single_process
from dscale.checkpoint._safe_io import SafeLoadPlanner, SafeReader, read_metadata
from dscale.checkpoint._staging import empty_copy
from dscale.checkpoint._states import (
    AGREEMENT_KEYS,
    Companion,
    ModelState,
    OptimizerState,
    TrainState,
    build_states,
    checked_by,
    placeholders,
    saved_by_position,
    scaler_update,
)

__all__ = ["load_checkpoint"]

logger = logging.getLogger(__name__)

# The manifest's algorithm and its (digest, name) entries for the data files.
_Sums = tuple[str, list[tuple[str, str]]]


def _check_keys(
    path: Path, metadata: Metadata, name: str, staged: Any, unplaced: dict[str, list[str]]
) -> None:
    """Raise CheckpointError when the checkpoint holds other entries than the model/optimizer.

    DCP ignores saved entries that the object being loaded lacks, so without this a
    checkpoint of a bigger model, or an optimizer of another kind, would load partially.
    Saved entries that are this rank's only problem go into ``unplaced``: another rank may
    hold them (a pipeline stage loads its own layers), which :func:`_placed_somewhere` asks.
    """
    flat, _ = flatten_state_dict({name: staged})
    here = set(flat)
    there = {k for k in metadata.state_dict_metadata if k.split(".", 1)[0] == name}
    if not there:
        raise CheckpointError(f"{path} has no {name} state; it was saved without {name}=...")
    lacking, missing = sorted(there - here), sorted(here - there)
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} entries are not in the checkpoint (e.g. {', '.join(missing[:3])})"
        )
    for key in sorted(here & there):
        saved, value = metadata.state_dict_metadata[key], flat[key]
        size = getattr(saved, "size", None)
        if size is not None and isinstance(value, torch.Tensor) and value.shape != size:
            parts.append(f"{key} has shape {tuple(size)} there and {tuple(value.shape)} here")
            break
    if lacking and not parts:
        unplaced[name] = lacking
        return
    if lacking:
        parts.insert(int(bool(missing)), _no_place(name, lacking))
    if parts:
        raise CheckpointError(
            f"{path} does not match the {name}: {'; '.join(parts)}; {_hint(name)}"
        )


def _hint(name: str) -> str:
    if name == "model":
        return "is it a checkpoint of another model?"
    return (
        "is the optimizer's state initialized (one step taken), is it of the same kind "
        "over the same parameters, with an lr scheduler where the run had one (a scheduler "
        "adds initial_lr to the param groups), or is it another run's checkpoint?"
    )


def _no_place(name: str, lacking: list[str]) -> str:
    return (
        f"{len(lacking)} saved entries have no place in the {name} "
        f"being loaded (e.g. {', '.join(lacking[:3])})"
    )


def _placed_somewhere(
    path: Path, unplaced: dict[str, list[str]], group: Any
) -> CheckpointError | None:
    """The saved entries that no rank's model or optimizer has a place for, as an error.

    A pipeline stage holds some layers only: what it lacks, another stage loads. Entries that
    every rank lacks are another model's. One gather of the names, on every rank alike.
    """
    gathered = _dist.all_gather_objects(unplaced, group)
    for name in ("model", "optimizer"):
        lacking = [set(ranks.get(name, ())) for ranks in gathered]
        nowhere = sorted(set.intersection(*lacking)) if lacking else []
        if nowhere:
            return CheckpointError(
                f"{path} does not match the {name}: {_no_place(name, nowhere)}; {_hint(name)}"
            )
    return None


def _stage(
    path: Path, states: Mapping[str, Any], metadata: Metadata, unplaced: dict[str, list[str]]
) -> dict[str, Any]:
    """Empty copies of every state to load into; checks model and optimizer keys."""
    staged: dict[str, Any] = {}
    saved = metadata.state_dict_metadata
    for name, state in states.items():
        if name == "scaler":
            if not any(k.startswith("scaler.") for k in saved):
                logger.warning("%s holds no scaler state; the scaler keeps its current state", path)
                continue
            staged[name] = placeholders(metadata, "scaler")
        elif name == "train":
            staged[name] = placeholders(metadata, "train")
        elif name in ("model", "optimizer"):
            if isinstance(state, OptimizerState):
                state.by_position = saved_by_position(metadata)  # a checkpoint of the old layout
            staged[name] = empty_copy(state.state_dict())
            _check_keys(path, metadata, name, staged[name], unplaced)
        else:
            if isinstance(state, Companion) and not any(k.startswith(name + ".") for k in saved):
                kind = type(state.obj).__name__
                raise CheckpointError(
                    f"{path} holds no {name} state, but the scaler has a {kind}: the checkpoint "
                    "was saved without it (before dscale saved FP8 state with the scaler, and "
                    f"without extra={{{name!r}: ...}}), and resuming would continue with fresh "
                    f"FP8 state, not the saved run's. Load a checkpoint saved with it, or build "
                    f"the {kind} after load_checkpoint() (it then starts fresh), or close() it "
                    "before loading"
                )
            if checked_by(state) is not None:
                # Read what was saved, whatever its shape: its own check names what differs.
                staged[name] = placeholders(metadata, name)
            else:
                staged[name] = empty_copy(state.state_dict())
                _check_named(path, saved, name, staged[name])
                _check_shapes(path, metadata, name, staged[name])
    _refuse_a_schedule_without_a_place(path, states, saved)
    return staged


def _refuse_a_schedule_without_a_place(
    path: Path, states: Mapping[str, Any], saved: Mapping[str, Any]
) -> None:
    """A scaler loaded from a checkpoint whose run had a dscale.precision.PrecisionSchedule
    needs one too: without it, every scheduled layer would train in the model's own format, not
    the saved run's, without a word (the weights alone load without ``scaler=``)."""
    key = "precision_schedule"
    if "scaler" in states and key not in states and any(k.startswith(key + ".") for k in saved):
        raise CheckpointError(
            f"{path} holds a dscale.precision.PrecisionSchedule's state ({key}: the saved run "
            "trained its scheduled layers in their formats), but the scaler being loaded has "
            "no PrecisionSchedule: the resumed run would train those layers in the model's own "
            "format. Build the same PrecisionSchedule on the scaler before load_checkpoint() "
            "(the saved map and step are restored), or load without scaler= to take the weights "
            "only"
        )


_NOT_EXTRAS = ("model", "optimizer", "scaler", "train")


def _check_named(path: Path, saved: Mapping[str, Any], name: str, staged: Any) -> None:
    """Raise CheckpointError when an extra with state has none in the checkpoint, naming the
    extras it holds (DCP's own refusal names a missing entry, not the saved names)."""
    flat, _ = flatten_state_dict({name: staged})
    if not flat or any(k.startswith(name + ".") for k in saved):
        return  # an empty state saves no entry
    held = sorted({k.split(".", 1)[0] for k in saved} - set(_NOT_EXTRAS))
    listed = ", ".join(repr(n) for n in held) if held else "none"
    raise CheckpointError(
        f"{path} holds no state for extra[{name!r}]; it holds extras: {listed}. Pass extra= "
        "with the names the run saved, or resume a checkpoint of this run (is it another run's?)"
    )


def _check_extras(path: Path, states: Mapping[str, Any], staged: dict[str, Any]) -> None:
    """Raise CheckpointError when an extra that checks its state refuses what was read."""
    for name, state in states.items():
        target = checked_by(state) if name in staged else None
        if target is None:
            continue
        try:
            target._checked_state(staged[name])
        except ValueError as exc:
            raise CheckpointError(f"{path} does not match {name}: {exc}") from None


def _check_shapes(path: Path, metadata: Metadata, name: str, staged: Any) -> None:
    """Raise CheckpointError when a saved tensor of an extra is not the shape loaded into.

    What DCP reads for it is then bounded by the extra's own tensors, as for the model.
    """
    flat, _ = flatten_state_dict({name: staged})
    for key, value in sorted(flat.items()):
        size = getattr(metadata.state_dict_metadata.get(key), "size", None)
        if size is not None and isinstance(value, torch.Tensor) and value.shape != size:
            raise CheckpointError(
                f"{path} does not match extra[{name!r}]: {key} has shape {tuple(size)} there "
                f"and {tuple(value.shape)} here; is it a checkpoint of another run?"
            )


def _inspect(
    path: Path, states: Mapping[str, Any], unplaced: dict[str, list[str]]
) -> tuple[_Sums, dict[str, Any]]:
    check_folder(path)
    sizes = check_regular_files(path)  # before anything is opened: a FIFO would block
    algorithm, entries = read_manifest(path)
    check_listed(path, [name for _, name in entries], sizes)
    # The small files every rank reads before any data: checked here, by every rank.
    small = [(digest, name) for digest, name in entries if not name.startswith("__")]
    corrupt = verify_share(path, small, 0, 1, algorithm)
    if corrupt is not None:
        raise CorruptCheckpointError(corrupt)
    read_format(path)
    metadata = read_metadata(path)
    # Before any placeholder is allocated: the shapes dscale writes, then the bytes on disk.
    if "scaler" in states:
        check_declared_shapes(path, metadata, "scaler", states["scaler"].scaler.state_dict())
    check_declared_shapes(path, metadata, "train", {})
    check_declared_sizes(path, metadata, sizes)
    data = [(digest, name) for digest, name in entries if name.startswith("__")]
    return (algorithm, data), _stage(path, states, metadata, unplaced)


def _read(path: Path, staged: dict[str, Any], sums: _Sums, group: Any) -> None:
    """DCP-load into ``staged`` while this rank hashes its share; raise what went wrong."""
    with ThreadPoolExecutor(1, thread_name_prefix="dscale-verify") as pool:
        algorithm, entries = sums
        hashing = pool.submit(
            verify_share, path, entries, _dist.rank(group), _dist.world_size(group), algorithm
        )
        read_error: CheckpointError | None = None
        try:
            with quiet_single_process():
                dcp_load(
                    staged,
                    storage_reader=SafeReader(path),
                    planner=SafeLoadPlanner(),
                    process_group=group,
                    no_dist=not _dist.is_distributed(group),
                )
        except CheckpointException as exc:
            read_error = CheckpointError(f"loading {path} failed: {describe_failure(exc)}")
        corrupt = hashing.result()
    if corrupt is not None:
        raise CorruptCheckpointError(corrupt)
    if read_error is not None:
        raise read_error


def agree_on_scaler(state: dict[str, Any] | None, group: Any) -> None:
    """Raise ScaleMismatchError on every rank unless all ranks will hold the same scale."""
    if state is None:
        return
    keys = [k for k in AGREEMENT_KEYS if k in state]
    rows = _dist.all_gather_floats([float(state[k]) for k in keys], group)
    if all(row == rows[0] for row in rows):
        return
    listed = "; ".join(
        f"rank {r}: " + ", ".join(f"{k}={v:g}" for k, v in zip(keys, row, strict=True))
        for r, row in enumerate(rows)
    )
    raise ScaleMismatchError(
        f"after loading, ranks would hold different scaler states ({listed}); every rank must "
        "load the same checkpoint into a scaler built with the same arguments"
    )


def _apply(states: Mapping[str, Any], staged: dict[str, Any], scaler_state: Any) -> int:
    for name, state in states.items():
        if name not in staged or name in ("scaler", "train"):
            continue
        if isinstance(state, ModelState):
            set_model_state_dict(state.model, staged[name])
        elif isinstance(state, OptimizerState):
            set_optimizer_state_dict(state.model, state.optimizer, staged[name])
        else:
            state.load_state_dict(staged[name])
    if scaler_state is not None:
        states["scaler"].scaler.load_state_dict(scaler_state)
    train: TrainState = states["train"]
    train.load_state_dict(staged["train"])
    return train.step


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
) -> int:
    """Load one published checkpoint folder and return its step; a refused one changes nothing.

    Every rank calls this with the same path. Nothing (model, optimizer, scaler, extras, RNG)
    changes until every check has passed on every rank.

    Raises:
        CheckpointError: missing folder, another format, unreadable or non-matching checkpoint,
            or a value that is not plain data; raised on every rank.
        CorruptCheckpointError: a file does not match its checksum.
        ScaleMismatchError: the ranks' scaler states differ (as saved, or as they would load).
    """
    path, group = Path(path), process_group
    states = build_states(
        step=0, model=model, optimizer=optimizer, scaler=scaler, extra=extra, group=group
    )
    with _fresh_optimizer_kept_fresh(states):
        return _load(path, states, scaler, group)


@contextlib.contextmanager
def _fresh_optimizer_kept_fresh(states: Mapping[str, Any]) -> Iterator[None]:
    """Take out again, when the load is refused, the state DCP gives a fresh optimizer.

    To learn a fresh optimizer's structure, torch's ``get_optimizer_state_dict`` steps it with
    zero grads and lr 0 (AdamW: step 1, zero moments); a refused load would leave that behind,
    and a run that went on would apply Adam's bias correction one step off.
    """
    state = states.get("optimizer")
    optimizer = state.optimizer if isinstance(state, OptimizerState) else None
    fresh = optimizer is not None and not optimizer.state
    try:
        yield
    except BaseException:
        if fresh:
            optimizer.state.clear()  # type: ignore[union-attr]
        raise


def _load(path: Path, states: dict[str, Any], scaler: Any, group: Any) -> int:
    problem: BaseException | None = None
    sums: _Sums = ("crc32", [])
    staged: dict[str, Any] = {}
    unplaced: dict[str, list[str]] = {}
    try:
        sums, staged = _inspect(path, states, unplaced)
    except CheckpointError as exc:
        problem = exc
    except Exception as exc:
        problem = CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc})")
    problem = _placed_somewhere(path, unplaced, group) or problem
    _dist.gather_then_raise(problem, group, f"checking {path}", ERROR_TYPES)

    scaler_state = None
    try:
        _read(path, staged, sums, group)
        _check_extras(path, states, staged)
        if "scaler" in staged:
            scaler_state = scaler_update(scaler, staged["scaler"])
    except (CheckpointError, ScaleMismatchError) as exc:
        problem = exc
    except Exception as exc:
        problem = CheckpointError(f"{path} cannot be loaded ({type(exc).__name__}: {exc})")
    _dist.gather_then_raise(problem, group, f"loading {path}", ERROR_TYPES)
    agree_on_scaler(scaler_state, group)

    step = _apply(states, staged, scaler_state)
    logger.info("loaded checkpoint %s (step %d) on rank %d", path, step, _dist.rank(group))
    return step
