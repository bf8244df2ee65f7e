"""Where one optimizer stands in the current iteration: its stage and its agreement.

One :class:`OptimizerState` per optimizer per iteration (``GradScaler._per_optimizer_states``;
torch's code reads it through ``_torch_compat.TorchOptimizerState``). The check
(``_check.py``) fills the agreement part, the decision (``_decision.py``) reads it,
update() forgets it.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

import torch

from dscale.scaler._program.agreement import Layout


class Stage(Enum):
    """torch's OptState, by name (``_torch_compat`` maps one onto the other)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class OptimizerState:
    stage: Stage = Stage.READY
    # This rank's agreement vector, then the agreed one once `work` is done; `layout` says
    # where each field sits in it.
    agreed: torch.Tensor | None = None
    layout: Layout | None = None
    work: Any = None  # pending all-reduce
    over_group: bool = False  # whether `agreed` was reduced over the scaler's group
    lone: bool = False  # whether the scaler had no process group (one process) at the check
    # Checked by step() before a step(grad_scaler=...) optimizer ran: its unscale_() then only
    # marks the stage (the check ran, and unscaled what it had to).
    prechecked: bool = False
    applied: bool | None = None  # known on the host when step() synced for its decision
    host_agreed: list[float] | None = None  # the agreed vector, read in that same sync
    # A rank-local flag written by code made for torch's scaler (["found_inf_per_device"]).
    user_found: torch.Tensor | None = None
    overflowed: bool | None = None  # with `applied`: whether the skip was for inf/NaN grads
    # The spike gate (_program/spike_gate.py) once decided: the spike flag, the step's values
    # and the skip flag (overflow or spike).
    spike: torch.Tensor | None = None
    spike_values: torch.Tensor | None = None
    skip: torch.Tensor | None = None
    # attach(): the backward passes through the models holding the optimizer's parameters when
    # it was checked; one more before its step means grads the check never saw.
    backwards: tuple[int, ...] = ()
    # unscale_(): the agreement waits for the first read of the flag, so that a flag torch-shaped
    # code writes in between (`late_found`) takes effect on every rank. `deferred`: not started
    # yet; `deferred_group`: the group it then runs over (None: none).
    deferred: bool = False
    deferred_group: Any = None
    late_found: torch.Tensor | None = None
    refused: Exception | None = None  # raised once this rank has joined the deferred agreement
