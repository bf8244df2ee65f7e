"""Checks around a load: file checksums before it, scaler agreement across ranks after it.

Both checks end with every rank knowing every rank's result, so a failure raises the same
error on every rank instead of one rank raising while the others wait.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed import ProcessGroup

from dscale.checkpoint import _comm
from dscale.checkpoint._errors import CorruptCheckpointError, ScaleMismatchError
from dscale.checkpoint._publish import verify_files
from dscale.checkpoint._states import AGREEMENT_KEYS

__all__ = ["verify_checksums", "verify_scaler_agreement"]


def verify_checksums(path: Path, group: ProcessGroup | None) -> None:
    """Raise CorruptCheckpointError on every rank if any file of ``path`` fails its checksum."""
    problem = verify_files(path, _comm.rank(group), _comm.world_size(group))
    error = None if problem is None else CorruptCheckpointError(problem)
    _comm.gather_then_raise(error, group, f"checksum verification of {path}")


def verify_scaler_agreement(scaler: Any, group: ProcessGroup | None) -> None:
    """Raise ScaleMismatchError on every rank unless all ranks hold the same scale and trackers."""
    state = scaler.state_dict()
    keys = [k for k in AGREEMENT_KEYS if k in state]
    if not keys:
        return  # a disabled scaler has no state
    rows = _comm.all_gather_floats([float(state[k]) for k in keys], group)
    if all(row == rows[0] for row in rows):
        return
    listed = "; ".join(
        f"rank {r}: " + ", ".join(f"{k}={v:g}" for k, v in zip(keys, row, strict=True))
        for r, row in enumerate(rows)
    )
    raise ScaleMismatchError(
        f"after loading, ranks hold different scaler states ({listed}); every rank must "
        "load the same checkpoint into a scaler built with the same arguments"
    )
