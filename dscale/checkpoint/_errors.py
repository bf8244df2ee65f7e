"""Exceptions raised by dscale.checkpoint."""

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
