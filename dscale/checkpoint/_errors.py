"""Exceptions raised by dscale.checkpoint, and how DCP's failures are put into words."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be used: missing, incomplete, or not matching what is being loaded.

    The message names the folder or file and what is wrong. It is a ValueError because the
    cause is the input (a path or a checkpoint), not the training state.
    """


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match the checksums written when it was published.

    ``resume="auto"`` treats this as "skip to the previous checkpoint"; every other
    CheckpointError stops the load.
    """


class ScaleMismatchError(RuntimeError):
    """Ranks hold different loss scales or growth trackers after a load.

    Raised on every rank with every rank's values, so that no rank waits on the others.
    """


class CheckpointSaveError(RuntimeError):
    """A save failed (a full disk, a read-only folder); the previous checkpoints are untouched.

    Raised on every rank. The unfinished folder is removed and the message says how much space
    the checkpoint needed and how much was free.
    """


ERROR_TYPES: tuple[type[Exception], ...] = (
    CorruptCheckpointError,
    CheckpointError,
    ScaleMismatchError,
    CheckpointSaveError,
)


def describe_failure(exc: BaseException) -> str:
    """DCP's per-rank failures (a CheckpointException) as one line per distinct message."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(exc).__name__}: {exc}"
    messages: dict[str, list[int]] = {}
    for rank, (error, *_) in sorted(failures.items()):
        messages.setdefault(f"{type(error).__name__}: {error}".strip(), []).append(rank)
    return "; ".join(f"{msg} (ranks {ranks})" for msg, ranks in messages.items())
