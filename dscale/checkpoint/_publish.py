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
    """Delete unpublished folders left by a crashed save (coordinator only).

    A leftover that is a symlink (or a file) is unlinked, never followed: writing through a
    symlinked ``.step-N.tmp`` would fill its target and publish a symlink as ``step-N``.
    """
    if not root.is_dir():
        return
    for path in root.iterdir():
        if not path.name.startswith(".step-"):
            continue
        if path.is_symlink() or not path.is_dir():
            logger.warning("removing %s: a leftover temp name that is not a folder", path)
            path.unlink()
        else:
            logger.info("removing unpublished checkpoint folder %s", path)
            shutil.rmtree(path, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final`` (coordinator only).

    An existing ``final`` (the same step saved again) is replaced; it is moved aside first, so
    a crash in between loses at most that one step and never leaves a half-written ``final``.
    """
    if tmp.is_symlink() or not tmp.is_dir():
        raise OSError(f"{tmp} is not a folder this save created (a symlink?); not publishing it")
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
