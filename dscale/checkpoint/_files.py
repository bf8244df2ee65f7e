"""Check a checkpoint folder's files and declared sizes before anything opens or allocates.

A checkpoint folder is input. Opening a FIFO for reading blocks until a writer appears, so a
FIFO in place of a data file would hang DCP's reader forever; a symlink could read a file from
outside the folder; and ``.metadata`` declares tensor sizes that the loader allocates before any
data is read. Here, with ``os.lstat`` only (nothing is opened):

* every entry of the folder is a regular file, or a symlink to one inside the folder;
* every data file holds at least the bytes its records occupy;
* every tensor chunk declared in ``.metadata`` fits in its tensor and in the bytes of its record
  (a record is a ``torch.save`` of the chunk, never smaller than the chunk's data);
* the bytes a load reads are on disk: a sparse file's holes read as zeros without taking space,
  so a hole could back a declared size from a tiny folder. A file with fewer blocks than its
  size (``st_blocks``) is asked for its holes (``SEEK_HOLE``); a hole is accepted only inside
  the data of a tensor record (its size is then checked against the model's own, and a
  filesystem that compresses may store zeros as holes), never in ``.metadata``, the manifest,
  a pickled value, after the last record or in a data file that no record names.

Hard links are accepted: a hard link reads the same checked bytes as a copy (and Linux's
``protected_hardlinks`` keeps one from reaching a file its creator could not read), and a save
never writes into an existing file (leftover temp folders are removed first).

A refusal is a CorruptCheckpointError naming the file or entry, so ``resume("auto")`` goes on to
the previous checkpoint, as it does for a file that fails its checksum.
"""

from __future__ import annotations

import bisect
import errno
import math
import os
import stat
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dscale.checkpoint._errors import CorruptCheckpointError

__all__ = ["check_declared_sizes", "check_listed", "check_regular_files", "holes"]

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
        if not entry.name.startswith("__"):  # read whole, before anything else: no holes
            gaps = holes(file, info)
            if gaps:
                raise _refuse(_sparse(file, info, sum(b - a for a, b in gaps), "the file"))
        sizes[entry.name] = info.st_size
    return sizes


def holes(file: Path, info: os.stat_result) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a regular file that are holes (not on disk).

    Only a file with fewer blocks than its size is opened; where the platform or filesystem
    cannot say (no ``st_blocks`` or ``SEEK_HOLE``), the file counts as having none.
    """
    blocks = getattr(info, "st_blocks", None)
    if blocks is None or blocks * 512 >= info.st_size or not hasattr(os, "SEEK_HOLE"):
        return []
    out: list[tuple[int, int]] = []
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in must not block
    try:
        pos = 0
        while pos < info.st_size:
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
            if hole >= info.st_size:
                break
            try:
                pos = os.lseek(fd, hole, os.SEEK_DATA)
            except OSError as exc:  # ENXIO: the hole runs to the end
                if exc.errno != errno.ENXIO:
                    raise
                pos = info.st_size
            out.append((hole, min(pos, info.st_size)))
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return []  # no SEEK_HOLE here
        raise
    finally:
        os.close(fd)
    return out


def _sparse(file: Path, info: os.stat_result, missing: int, where: str) -> str:
    on_disk = getattr(info, "st_blocks", 0) * 512
    return (
        f"{file} is a sparse file: {missing} bytes of {where} are holes, not on disk "
        f"({on_disk} bytes on disk for a size of {info.st_size}); a load would read zeros "
        "that were never written"
    )


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
    _check_holes(path, metadata, sizes)


def _check_holes(path: Path, metadata: Metadata, sizes: dict[str, int]) -> None:
    """Raise unless every hole of a data file lies inside the data of one tensor record.

    Data files that no record names count too: the manifest has them hashed, all through.
    """
    records: dict[str, list[tuple[int, int, int, str]]] = {
        name: [] for name in sizes if name.startswith("__")
    }
    for index, info in metadata.storage_data.items():
        meta = metadata.state_dict_metadata.get(index.fqn)
        data = 0  # bytes of the record that may be holes: a tensor chunk's data, never pickles
        if isinstance(meta, TensorStorageMetadata):
            chunk = next((c for c in meta.chunks if c.offsets == index.offset), None)
            if chunk is not None:
                data = math.prod(chunk.sizes) * meta.properties.dtype.itemsize
        end = info.offset + info.length
        records.setdefault(info.relative_path, []).append((info.offset, end, data, index.fqn))
    for name, spans in sorted(records.items()):
        file = path / name
        info = os.stat(file)
        gaps = holes(file, info)
        if not gaps:
            continue
        spans.sort()
        starts = [start for start, _, _, _ in spans]
        in_record = [0] * len(spans)
        for start, end in gaps:
            outside = end - start
            i = max(bisect.bisect_right(starts, start) - 1, 0)
            while i < len(spans) and spans[i][0] < end:
                overlap = min(end, spans[i][1]) - max(start, spans[i][0])
                if overlap > 0:
                    in_record[i] += overlap
                    outside -= overlap
                i += 1
            if outside > 0:
                raise _refuse(_sparse(file, info, outside, "no record"))
        for (_, _, data, fqn), missing in zip(spans, in_record, strict=True):
            if missing > data:
                what = f"the record of {fqn!r}" + ("" if data else " (a pickled value)")
                raise _refuse(_sparse(file, info, missing, what))
