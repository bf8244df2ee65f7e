"""Check a checkpoint folder's files and declared sizes before anything opens or allocates.

A checkpoint folder is input. Opening a FIFO for reading blocks until a writer appears, so a
FIFO in place of a data file would hang DCP's reader forever; a symlink could read a file from
outside the folder; and ``.metadata`` declares tensor sizes that the loader allocates before any
data is read. Here, with ``os.lstat`` only (nothing is opened):

* every entry of the folder is a regular file, or a symlink to one inside the folder;
* every data file holds at least the bytes its records occupy;
* every tensor chunk declared in ``.metadata`` fits in its tensor and in the bytes of its record
  (a record is a ``torch.save`` of the chunk, never smaller than the chunk's data).

A refusal is a CorruptCheckpointError naming the file or entry, so ``resume("auto")`` goes on to
the previous checkpoint, as it does for a file that fails its checksum.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dscale.checkpoint._errors import CorruptCheckpointError

__all__ = ["check_declared_sizes", "check_listed", "check_regular_files"]

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}

_FIX = "restore the folder from a copy you trust, or load an earlier checkpoint"


def _refuse(what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{what}; nothing was opened or loaded; {_FIX}")


def check_regular_files(path: Path) -> dict[str, int]:
    """Sizes of the folder's files by name; raise unless each is a regular file of the folder.

    Nothing is opened: a FIFO is named, not read.
    """
    folder = os.path.realpath(path)
    sizes: dict[str, int] = {}
    for entry in os.scandir(path):
        file = Path(path) / entry.name
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            target = os.path.realpath(file)
            if os.path.dirname(target) != folder:
                raise _refuse(f"{file} is a symlink to {target}, outside the checkpoint folder")
            try:
                info = os.stat(target)
            except OSError:
                raise _refuse(f"{file} is a symlink to {target}, which does not exist") from None
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise _refuse(f"{file} is {kind}, not a regular file")
        sizes[entry.name] = info.st_size
    return sizes


def check_listed(path: Path, listed: list[str], sizes: dict[str, int]) -> None:
    """Raise unless every file the manifest lists is among the folder's regular files."""
    for name in listed:
        if name not in sizes:
            raise _refuse(f"{Path(path) / name} is missing (listed in the checksum manifest)")


def check_declared_sizes(path: Path, metadata: Metadata, sizes: dict[str, int]) -> None:
    """Raise unless every record lies inside its file and every tensor chunk inside its record.

    This bounds what a load allocates by the bytes on disk: a small folder whose ``.metadata``
    declares a huge tensor is refused here, before any placeholder is made for it.
    """
    for index, info in metadata.storage_data.items():
        size = sizes.get(info.relative_path)
        if size is None:
            raise _refuse(f"{path / info.relative_path} is missing (named by .metadata)")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise _refuse(
                f"{path / info.relative_path} is corrupt: truncated to {size} bytes, but "
                f".metadata places {index.fqn!r} at bytes {info.offset}.."
                f"{info.offset + info.length}"
            )
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        itemsize = meta.properties.dtype.itemsize
        declared = math.prod(meta.size) * itemsize
        covered = 0
        for chunk in meta.chunks:
            inside = len(chunk.offsets) == len(chunk.sizes) == len(meta.size) and all(
                o >= 0 and s >= 0 and o + s <= n
                for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size, strict=True)
            )
            record = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            needed = math.prod(chunk.sizes) * itemsize
            if not inside or (needed and (record is None or record.length < needed)):
                stored = "no record" if record is None else f"a record of {record.length} bytes"
                raise _refuse(
                    f"{path / '.metadata'} declares {fqn!r} as {tuple(meta.size)} "
                    f"{meta.properties.dtype} ({declared} bytes), with a chunk of "
                    f"{tuple(chunk.sizes)} at {tuple(chunk.offsets)} backed by {stored}: "
                    "the sizes it declares are not the bytes on disk"
                )
            covered += needed
        if covered < declared:
            raise _refuse(
                f"{path / '.metadata'} declares {fqn!r} as {tuple(meta.size)} ({declared} "
                f"bytes) but its chunks hold {covered} bytes"
            )
