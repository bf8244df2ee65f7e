"""What a checkpoint folder holds, and the errors for folders that are not one.

``root/step-N/`` holds DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files, ``dscale.json``
(format name, version, step, world size) and ``checksums.crc32`` (one ``<crc32 hex>  <name>``
line per file), which is written last: a folder without it is not complete. Folders of format
version 1 have ``checksums.sha256`` (the ``sha256sum -c`` format) instead, and still load.
Saves go to ``root/.step-N.tmp``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dscale.checkpoint._errors import CheckpointError
from dscale.checkpoint._files import check_regular_files

__all__ = [
    "FORMAT_FILE",
    "FORMAT_VERSION",
    "MANIFEST",
    "check_folder",
    "find_manifest",
    "format_json",
    "list_complete",
    "read_format",
    "read_manifest",
    "step_dir",
    "temp_dir",
]

# CRC32, not sha256: it detects the corruption a manifest is for (the manifest is not signed,
# so it never stopped tampering) at three times the speed, which keeps verification within 25%
# of an unverified save or load on a busy machine.
MANIFEST = "checksums.crc32"
MANIFESTS = {"checksums.crc32": "crc32", "checksums.sha256": "sha256"}
_DIGEST_LENGTH = {"crc32": 8, "sha256": 64}
FORMAT_FILE = "dscale.json"
FORMAT_NAME = "dscale.checkpoint"
# 1: the layout before dscale.json existed (loads as is). 2: dscale.json, per-rank hashes.
FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OTHER_FORMATS = {
    ".safetensors": "a safetensors file (Hugging Face)",
    ".bin": "a torch.save file",
    ".pt": "a torch.save file",
    ".pth": "a torch.save file",
    ".ckpt": "a Lightning or torch.save file",
    ".npz": "a NumPy archive",
}


def step_dir(root: Path, step: int) -> Path:
    """The published folder of the checkpoint taken after ``step`` iterations."""
    return root / f"step-{step}"


def temp_dir(root: Path, step: int) -> Path:
    """Where ranks write the checkpoint of ``step`` before it is published."""
    return root / f".step-{step}.tmp"


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoints under ``root`` as ``(step, path)``, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and find_manifest(path) is not None:
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def find_manifest(path: Path) -> Path | None:
    """The folder's checksum manifest (either algorithm), or None."""
    for name in MANIFESTS:
        if (path / name).is_file():
            return path / name
    return None


def format_json(step: int, world_size: int) -> str:
    """The content of ``dscale.json`` for a checkpoint of ``step`` saved by ``world_size`` ranks."""
    return json.dumps(
        {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step, "world_size": world_size}
    )


def _describe_other(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir())[:8]
    kinds = sorted({k for suffix, k in _OTHER_FORMATS.items() for n in names if n.endswith(suffix)})
    if (path / ".metadata").is_file():
        return (
            f"{path} is a DCP checkpoint without {MANIFEST}: it was not written by "
            "dscale.checkpoint, or its save was interrupted; load it with "
            "torch.distributed.checkpoint if you trust it"
        )
    if any(_STEP_DIR.match(n) for n in names):
        return (
            f"{path} is a checkpoint directory, not one checkpoint; pass one of its step-N "
            "folders, or use resume='auto' with this directory as the CheckpointManager's"
        )
    found = f" (it holds {', '.join(kinds)})" if kinds else ""
    listing = ", ".join(names) if names else "nothing"
    return (
        f"{path} is not a dscale checkpoint{found}: no {MANIFEST} or .metadata, only "
        f"{listing}; pass a step-N folder written by dscale.checkpoint"
    )


def check_folder(path: Path) -> None:
    """Raise CheckpointError unless ``path`` looks like a published dscale checkpoint folder."""
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
    if find_manifest(path) is None:
        if any((path / name).is_symlink() or (path / name).exists() for name in MANIFESTS):
            check_regular_files(path)  # a manifest that is a folder or a FIFO: named, corrupt
        if not (path / ".metadata").is_file() and not any(path.iterdir()):
            raise CheckpointError(f"checkpoint folder {path} is empty")
        if (path / ".metadata").is_file() and path.name.endswith(".tmp"):
            raise CheckpointError(
                f"{MANIFEST} is missing: {path} was not published completely "
                "(a save was interrupted); load a step-N folder instead"
            )
        raise CheckpointError(_describe_other(path))


def read_manifest(path: Path) -> tuple[str, list[tuple[str, str]]]:
    """The algorithm and ``(digest, file name)`` for every listed file; CheckpointError if bad."""
    manifest = find_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path / MANIFEST} is missing: {path} was not published completely")
    algorithm = MANIFESTS[manifest.name]
    entries = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if (
            not sep
            or len(digest) != _DIGEST_LENGTH[algorithm]
            or "/" in name
            or name in ("", ".", "..")
        ):
            raise CheckpointError(f"{manifest} line {number} is malformed: {line!r}")
        entries.append((digest, name))
    if not any(name == ".metadata" for _, name in entries):
        raise CheckpointError(
            f"{manifest} does not list .metadata: {path} is not a complete DCP checkpoint"
        )
    return algorithm, entries


def read_format(path: Path) -> dict[str, Any]:
    """``dscale.json`` as a dict (version 1 when absent); CheckpointError for another format."""
    file = path / FORMAT_FILE
    if not file.is_file():
        return {"format": FORMAT_NAME, "version": 1}
    try:
        info = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(info, dict) or info.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{file} does not describe a {FORMAT_NAME} folder: {info!r}")
    version = info.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version!r}, but this dscale reads versions up to "
            f"{FORMAT_VERSION}; load it with a newer dscale"
        )
    return info
