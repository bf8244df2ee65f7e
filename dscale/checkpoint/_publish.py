"""Make a checkpoint complete or absent: rename the finished temp folder, keep the last K.

Ranks write into ``.step-N.tmp``; the coordinator's writer adds the manifest once every rank has
written (see ``_hashing.py``). Only then does the coordinator rename the folder to ``step-N``. A
crash at any point before the rename leaves only a temp folder, which is never loaded, and the
published checkpoints as they were.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from dscale.checkpoint._layout import MANIFEST, list_complete

__all__ = ["publish", "purge", "remove_temp_dirs"]

logger = logging.getLogger(__name__)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temp_dirs(root: Path) -> None:
    """Delete unpublished folders left by a crashed save (coordinator only)."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(".step-") and path.is_dir():
            logger.info("removing unpublished checkpoint folder %s", path)
            shutil.rmtree(path, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final`` (coordinator only).

    An existing ``final`` (the same step saved again) is replaced; it is moved aside first, so
    a crash in between loses at most that one step and never leaves a half-written ``final``.
    """
    if not (tmp / MANIFEST).is_file():
        raise OSError(f"{tmp / MANIFEST} is missing: the save did not finish on every rank")
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    logger.info("published checkpoint %s", final)


def purge(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` published checkpoints (coordinator only)."""
    for _, path in list_complete(root)[keep:]:
        logger.info("removing old checkpoint %s (keep=%d)", path, keep)
        shutil.rmtree(path, ignore_errors=True)
