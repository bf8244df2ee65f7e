"""The Stateful pieces of a checkpoint: model, optimizer, scaler, step and RNG states.

Everything dscale adds is stored as tensors, so nothing of ours goes through DCP's pickled
byte values. Values that differ per rank (the scale as each rank saw it, RNG states) are stored
as a world-sized tensor sharded over ranks: DCP keeps one copy of a replicated key, chosen from
some rank, which would hide exactly the disagreement a load must detect.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from dscale import _dist
from dscale.checkpoint._errors import ScaleMismatchError

__all__ = [
    "Companion",
    "ModelState",
    "OptimizerState",
    "ScalerState",
    "TrainState",
    "build_states",
    "checked_by",
    "placeholders",
    "scaler_update",
]

logger = logging.getLogger(__name__)

# Scaler keys every rank must agree on; each rank's value is stored separately.
AGREEMENT_KEYS = ("scale", "_growth_tracker", "_hysteresis_tracker")


def _per_rank(local: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """A ``[world, *local.shape]`` tensor whose row r is rank r's ``local``."""
    row = local.detach().cpu().unsqueeze(0)
    if not _dist.is_distributed(group):
        return row
    from torch.distributed import group as groups
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    world = group if group is not None else groups.WORLD
    if world is None:  # only when not initialized, which is_distributed() excluded
        return row
    mesh = DeviceMesh.from_group(world, device_type="cpu")
    return DTensor.from_local(row, mesh, [Shard(0)], run_check=False)


def placeholders(metadata: Metadata, prefix: str) -> dict[str, Any]:
    """Zero tensors shaped like every saved tensor under ``prefix``, as a nested dict.

    DCP loads in place, so the structure to load into must exist; building it from the
    checkpoint lets a scaler of another kind (torch's vs dscale's) load what is there.
    """
    out: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix + ".") or not isinstance(meta, TensorStorageMetadata):
            continue
        *parents, leaf = fqn[len(prefix) + 1 :].split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = torch.zeros(meta.size, dtype=meta.properties.dtype)
    return out


class ModelState:
    """The model's state dict with wrapper prefixes removed (DDP, FSDP1 and FSDP2 alike)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


_POSITIONAL_GROUP = re.compile(r"optimizer\.param_groups\.\d+\.params")


def saved_by_position(metadata: Metadata) -> bool:
    """Whether the checkpoint keeps the optimizer's param groups by position, as dscale wrote
    them before it keyed them by parameter name (``optimizer.param_groups.0.params``)."""
    return any(_POSITIONAL_GROUP.fullmatch(key) for key in metadata.state_dict_metadata)


class OptimizerState:
    """A torch optimizer's state dict keyed by parameter names, so it reshards with the model.

    The param groups are keyed by parameter name too (``param_groups.<fqn>.lr``; torch's
    ``flatten_optimizer_state_dict``): keyed by position, the stages of a pipeline would all
    write ``param_groups.0.*``, DCP would keep one stage's, and the others would load its
    parameter names (AdamW then failed with ``KeyError: 'betas'`` at its first step).
    ``by_position=True`` reads a checkpoint written the old way (set by the load from the
    checkpoint's keys). An optimizer whose state holds values torch cannot flatten (other than
    tensors and numbers) is saved by position, as before.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, by_position: bool = False
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.by_position = by_position

    def state_dict(self) -> dict[str, Any]:
        if not self.by_position:
            try:
                return get_optimizer_state_dict(self.model, self.optimizer, options=_BY_NAME)
            except NotImplementedError:  # a state value torch's flattening does not take
                pass
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch tells the two layouts apart by the nested one's "state" key.
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


class ScalerState:
    """A GradScaler (dscale's or torch's) as a DCP Stateful that keeps every state-dict entry.

    Saved keys, one per entry of ``scaler.state_dict()``: ``values.<key>`` for numbers (float64,
    int64 or bool scalars) and tensors (the spike gate's window; policy="predictive"'s lists of
    floats as float64), ``text.<key>`` for strings (UTF-8 bytes as a uint8 tensor:
    spike_signals, hysteresis_refill, policy), ``none.<key>`` for None (min_scale, max_scale);
    and ``per_rank.<key>`` for scale and trackers, one row per rank.
    Loading goes through :func:`scaler_update`, which checks before anything changes.
    """

    def __init__(self, scaler: Any, group: ProcessGroup | None) -> None:
        self.scaler = scaler
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        values: dict[str, torch.Tensor] = {}
        text: dict[str, torch.Tensor] = {}
        none: dict[str, torch.Tensor] = {}
        for key, value in self.scaler.state_dict().items():
            if value is None:
                none[key] = torch.tensor(True)
            elif isinstance(value, str):
                text[key] = torch.tensor(list(value.encode()), dtype=torch.uint8)
            elif isinstance(value, bool):
                values[key] = torch.tensor(value)
            elif isinstance(value, int):
                values[key] = torch.tensor(value, dtype=torch.int64)
            elif isinstance(value, float):
                values[key] = torch.tensor(value, dtype=torch.float64)
            elif isinstance(value, torch.Tensor):  # the spike gate's window
                values[key] = value.detach().cpu()
            elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
                values[key] = torch.tensor(value, dtype=torch.float64)  # predictive rings
            else:
                raise TypeError(
                    f"the scaler's state_dict()[{key!r}] is a {type(value).__name__}, which a "
                    "checkpoint cannot store; expected a number, str, None, tensor or list of "
                    "floats"
                )
        per_rank = {
            key: _per_rank(values[key].to(torch.float64).reshape(1), self.group)
            for key in AGREEMENT_KEYS
            if key in values
        }
        out: dict[str, Any] = {"values": values, "per_rank": per_rank}
        if text:
            out["text"] = text
        if none:
            out["none"] = none
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = scaler_update(self.scaler, state_dict)
        if state is not None:
            self.scaler.load_state_dict(state)


def _decoded(saved: dict[str, Any]) -> dict[str, Any]:
    """The state dict as the saving scaler returned it (lists come back as tensors)."""
    state: dict[str, Any] = {}
    for key, tensor in saved.get("values", {}).items():
        if tensor.dim() > 0:  # a tensor entry (window, ring) stays a tensor
            state[key] = tensor.clone()
        elif tensor.dtype == torch.bool:
            state[key] = bool(tensor)
        elif tensor.is_floating_point():
            state[key] = float(tensor)
        else:
            state[key] = int(tensor)
    for key, tensor in saved.get("text", {}).items():
        try:
            state[key] = bytes(tensor.reshape(-1).tolist()).decode("utf-8")
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"state_dict: {key} is not UTF-8 text ({exc})") from None
    for key in saved.get("none", {}):
        state[key] = None
    return state


def scaler_update(scaler: Any, saved: dict[str, Any]) -> dict[str, Any] | None:
    """The state dict ``scaler`` will load from ``saved``; None if nothing is saved.

    Checks, without changing ``scaler``, that the saving ranks agreed and that the scaler
    accepts the dict: dscale's scaler runs exactly the checks of its load_state_dict (a window
    of other spike signals, a StepGuard's dict into a GradScaler, bad values); torch's takes
    any values. The dict is the saved one, entry for entry: keys it lacks (a checkpoint of
    torch's scaler, or one saved before strings were kept) are filled as load_state_dict fills
    them.
    """
    check_saved_agreement(saved.get("per_rank", {}))
    if not saved.get("values", {}):
        return None  # saved from a disabled scaler
    state = _decoded(saved)
    checked = getattr(scaler, "_checked_state", None)
    if checked is not None and scaler.is_enabled():
        checked(state)  # raises ValueError; changes nothing
    return state


def check_saved_agreement(per_rank: dict[str, torch.Tensor]) -> None:
    """Raise ScaleMismatchError if the saving ranks disagreed on scale or trackers.

    Every rank reads the same saved rows, so every rank raises the same error without a
    collective.
    """
    problems = []
    for key, rows in sorted(per_rank.items()):
        values = rows.reshape(-1).tolist()
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {r}: {v:g}" for r, v in enumerate(values))
            problems.append(f"{key} differs between the saving ranks ({listed})")
    if problems:
        raise ScaleMismatchError(
            "the checkpoint's scaler state is not the same on every rank: "
            + "; ".join(problems)
            + ". Loading it would make ranks take different skip/grow decisions; "
            "load an earlier checkpoint or reset the scaler"
        )


def _python_rng_rows() -> tuple[torch.Tensor, torch.Tensor]:
    version, internal, gauss = random.getstate()
    state = torch.tensor([version, *internal], dtype=torch.int64)
    return state, torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64)


def _set_python_rng(state: torch.Tensor, gauss: torch.Tensor) -> None:
    version, *internal = state.tolist()
    g = float(gauss[0])
    random.setstate((version, tuple(internal), None if g != g else g))


class TrainState:
    """The step counter (iterations completed), the saving world size and per-rank RNG states.

    RNG states come back only when the world size is unchanged; with another world size
    there is no rank to take them from, and a log line says so.
    """

    def __init__(self, step: int, group: ProcessGroup | None):
        self.step = step
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        py_state, py_gauss = _python_rng_rows()
        rng = {
            "torch_cpu": _per_rank(torch.get_rng_state(), self.group),
            "python": _per_rank(py_state, self.group),
            "python_gauss": _per_rank(py_gauss, self.group),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            rng["cuda"] = _per_rank(torch.cuda.get_rng_state(), self.group)
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "world_size": torch.tensor(_dist.world_size(self.group), dtype=torch.int64),
            "rng": rng,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        saved_world = int(state_dict["world_size"])
        world, me = _dist.world_size(self.group), _dist.rank(self.group)
        if saved_world != world:
            logger.info(
                "RNG states not restored: saved by %d ranks, loading on %d, so each rank's random "
                "streams start again from the seed; the global batch (each rank's batch x ranks) "
                "changes by %d/%d unless each rank's batch is scaled by %d/%d",
                saved_world,
                world,
                world,
                saved_world,
                saved_world,
                world,
            )
            return
        rng = state_dict.get("rng", {})
        if "torch_cpu" in rng:
            torch.set_rng_state(rng["torch_cpu"][me].to(torch.uint8).clone())  # no view
        if "python" in rng and "python_gauss" in rng:
            _set_python_rng(rng["python"][me], rng["python_gauss"][me])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"][me].to(torch.uint8).clone())


_RESERVED = ("scaler", "train", "model", "optimizer")


def build_states(
    *,
    step: int,
    model: torch.nn.Module | None,
    optimizer: Any,
    scaler: Any,
    extra: Mapping[str, Any] | None,
    group: ProcessGroup | None,
) -> dict[str, Any]:
    """The top-level DCP state dict of Statefuls; checks the arguments first."""
    states: dict[str, Any] = {}
    if scaler is not None:
        states["scaler"] = ScalerState(scaler, group)
    states["train"] = TrainState(step, group)
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
    if scaler is not None:
        states.update(_companions(scaler, extra or {}))
    return states


class Companion:
    """The scaler's FP8 companion (``dscale.fp8``'s weight scales, numerics, fallback) as a
    Stateful: saved and loaded with the scaler under its reserved key without being named.

    A checkpoint that lacks its state is refused on load (``_load``): resuming without it
    would continue with fresh FP8 state, silently not the saved run.
    """

    def __init__(self, key: str, obj: Any) -> None:
        self.key = key
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


def checked_by(state: Any) -> Any:
    """The object whose ``_checked_state`` validates ``state``'s saved dict, or None."""
    target = state.obj if isinstance(state, Companion) else state
    return target if callable(getattr(target, "_checked_state", None)) else None


def _companions(scaler: Any, extra: Mapping[str, Any]) -> dict[str, Companion]:
    """The scaler's FP8 companions not already passed in ``extra`` (by identity: no double)."""
    from dscale.fp8 import _attached  # no torchao import: the table of companions only

    given = {id(v) for v in extra.values()}
    found = {}
    for key, obj in _attached.companions(scaler).items():
        if id(obj) in given:
            continue
        if key in extra:
            raise ValueError(
                f"extra[{key!r}] is not the scaler's {type(obj).__name__}, whose state is saved "
                f"with the scaler under that key; pass the scaler's own there (or leave it out: "
                "it travels with the scaler), or save yours under another key"
            )
        found[key] = Companion(key, obj)
    for key, others in _attached.shadowed(scaler).items():
        left = [obj for obj in others if id(obj) not in given]
        if left:  # every rank holds the same companions: every rank raises here alike
            kind = type(left[0]).__name__
            raise ValueError(
                f"the scaler has {len(others) + 1} live {kind} objects (several models or "
                f"optimizers on one scaler, or one built again without close()), and only one "
                f"travels with it under {key!r}: the others' state would be lost on resume. "
                f"Pass each under its own key in extra= (e.g. extra={{'{key}_2': second}}), "
                "close() the ones no longer used, or give each model its own scaler"
            )
    return found
