"""Make a checkpoint complete or absent: temp folder, checksums, atomic rename, keep last K.

Ranks write into ``.step-N.tmp``. Once every rank has written (DCP's coordinator writes
``.metadata`` only after gathering every rank's write results), the coordinator hashes the files
into ``checksums.sha256`` (the ``sha256sum -c`` format) and renames the folder to ``step-N``. A
crash at any point before the rename leaves only a temp folder, which is never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

__all__ = [
    "MANIFEST",
    "list_complete",
    "publish",
    "purge",
    "remove_temp_dirs",
    "step_dir",
    "temp_dir",
    "verify_files",
]

logger = logging.getLogger(__name__)

MANIFEST = "checksums.sha256"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


def step_dir(root: Path, step: int) -> Path:
    """The published folder of the checkpoint taken after ``step`` iterations."""
    return root / f"step-{step}"


def temp_dir(root: Path, step: int) -> Path:
    """Where ranks write the checkpoint of ``step`` before it is published."""
    return root / f".step-{step}.tmp"


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
    """Write the checksum manifest into ``tmp``, then rename it to ``final`` (coordinator only).

    An existing ``final`` (the same step saved again) is replaced; it is moved aside first, so
    a crash in between loses at most that one step and never leaves a half-written ``final``.
    """
    lines = [
        f"{_sha256(f)}  {f.name}\n"
        for f in sorted(tmp.iterdir())
        if f.is_file() and f.name != MANIFEST
    ]
    manifest = tmp / MANIFEST
    with manifest.open("w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    logger.info("published checkpoint %s (%d files)", final, len(lines))


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoints under ``root`` as ``(step, path)``, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def purge(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` published checkpoints (coordinator only)."""
    for _, path in list_complete(root)[keep:]:
        logger.info("removing old checkpoint %s (keep=%d)", path, keep)
        shutil.rmtree(path, ignore_errors=True)


def verify_files(path: Path, shard: int = 0, num_shards: int = 1) -> str | None:
    """Check this share of the manifest's files; return what is wrong, or None.

    Each rank checks every ``num_shards``-th file, so the ranks share the reading.
    """
    manifest = path / MANIFEST
    if not path.is_dir():
        return f"checkpoint folder {path} does not exist"
    if not manifest.is_file():
        return (
            f"{manifest} is missing: {path} was not published completely "
            "(a save was interrupted, or it was not written by dscale.checkpoint)"
        )
    entries = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or "/" in name:
            return f"{manifest} line {number} is malformed: {line!r}"
        entries.append((digest, name))
    if not any(name == ".metadata" for _, name in entries):
        return f"{manifest} does not list .metadata: {path} is not a complete DCP checkpoint"
    for digest, name in entries[shard::num_shards]:
        file = path / name
        if not file.is_file():
            return f"{file} is missing (listed in {MANIFEST})"
        actual = _sha256(file)
        if actual != digest:
            return (
                f"{file} is corrupt: sha256 {actual[:16]}... does not match "
                f"{digest[:16]}... recorded in {MANIFEST} when it was saved"
            )
    return None
