"""Checksums computed where the bytes are: each rank sums the files it writes, or a share to read.

The checksum is CRC32 (zlib, as in zip files; see ``_layout.MANIFEST`` for why); folders of
format version 1 carry sha256 and are checked with it.

On save, every rank sums its own ``__<rank>_*.distcp`` files as DCP writes them: the stream
sums each buffer as it passes (no second read), in each of DCP's writer threads, and zlib
releases the GIL, so ranks and threads work in parallel. The digests travel to the coordinator
with DCP's write results (so async saves hash in the background too), and the coordinator only
adds ``.metadata`` and ``dscale.json`` and writes the manifest. On load, each rank hashes its
share of the files, in parallel threads, while DCP reads; nothing is applied before every share
has checked out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import zlib
from collections.abc import Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dscale.checkpoint._layout import FORMAT_FILE, MANIFEST, format_json

__all__ = ["HashingWriter", "file_digest", "new_digest", "verify_share", "writer_threads"]

_CHUNK = 8 << 20
_DIGEST_KEY = "__dscale_checksum__/"


class _Crc32:
    """zlib.crc32 behind hashlib's update()/hexdigest(); zlib releases the GIL on big buffers."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_digest(algorithm: str = "crc32") -> Any:
    """A running checksum: ``crc32`` (what dscale writes) or ``sha256`` (format version 1)."""
    return _Crc32() if algorithm == "crc32" else hashlib.new(algorithm)


def writer_threads() -> int:
    """Files (and threads) per rank: DCP writes and we hash that many files in parallel."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def file_digest(file: Path, algorithm: str = "crc32") -> str:
    """The file's checksum as hex; the GIL is released, so threads overlap with I/O."""
    digest = new_digest(algorithm)
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(file: Path, text: str) -> None:
    with file.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _without_torch_crc32() -> Generator[None, None, None]:
    """Skip the CRC32 torch.save puts in each record's zip entry while we write.

    DCP never checks it on load, and the checksum we compute covers the same bytes; computing
    both cost as much again as the write itself here. The setting is process-wide: another
    thread's torch.save meanwhile also skips it (torch.load accepts such files).
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


class _HashingStream:
    """A file opened for writing that sums every buffer before it goes to the file.

    Inline, not in a thread of its own: CRC32 costs less than copying the buffer for another
    thread would (measured: 2 GB in 1.8 s inline, 4.4 s through a thread, 5.0 s for plain DCP
    with torch's own CRC32, on 2 busy cores).
    """

    def __init__(self, raw: Any, errors: list[OSError]) -> None:
        self._raw = raw
        self._errors = errors
        self._digest = new_digest()

    def write(self, data: Any) -> int:
        self._digest.update(data)
        try:
            written: int = self._raw.write(data)
        except OSError as exc:
            # torch.save's zip writer replaces this with "unexpected pos"; keep the real cause.
            self._errors.append(exc)
            raise
        return written

    def hexdigest(self) -> str:
        """The checksum of everything written."""
        return str(self._digest.hexdigest())

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._raw, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, summing every file it writes; ``digests`` maps name to CRC32."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}
        self.errors: list[OSError] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw, self.errors)
            try:
                yield stream
            finally:
                digest = stream.hexdigest()
        with self._lock:
            self.digests[Path(path).name] = digest


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, plus per-rank file hashes and a manifest written by the coordinator.

    The manifest (``checksums.crc32``) is written last, after ``.metadata``: a folder holding
    it has every rank's data.
    """

    def __init__(self, path: Path, *, step: int, world_size: int) -> None:
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=True,
            thread_count=writer_threads(),
            overwrite=True,
        )
        self.fs: _HashingFileSystem = _HashingFileSystem()
        self._format = format_json(step, world_size)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            with _without_torch_crc32():
                results: list[WriteResult] = super().write_data(plan, planner).wait()
        except Exception as exc:
            if self.fs.errors:  # a full disk, a read-only file system: say so
                raise self.fs.errors[0] from exc
            raise
        names = sorted({r.storage_data.relative_path for r in results})
        digests = [
            WriteResult(
                index=MetadataIndex(_DIGEST_KEY + name),
                size_in_bytes=0,
                storage_data=self.fs.digests[name],
            )
            for name in names
        ]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results + digests)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, str] = {}
        data: list[list[WriteResult]] = []
        for rank_results in results:
            data.append([])
            for r in rank_results:
                if r.index.fqn.startswith(_DIGEST_KEY):
                    digests[r.index.fqn[len(_DIGEST_KEY) :]] = r.storage_data
                else:
                    data[-1].append(r)
        super().finish(metadata, data)
        folder = Path(self.path)
        _write_synced(folder / FORMAT_FILE, self._format)
        for name in (".metadata", FORMAT_FILE):  # small files
            digests[name] = file_digest(folder / name)
        lines = "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
        _write_synced(folder / MANIFEST, lines)


def _owner(name: str, world_size: int) -> int:
    """The rank that checks ``name``: ``__<r>_*`` goes to rank r (mod world), the rest to rank 0.

    At the saving world size this is the rank that reads that file anyway.
    """
    if name.startswith("__"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head) % world_size
    return 0


def verify_share(
    path: Path,
    entries: Iterable[tuple[str, str]],
    rank: int,
    world_size: int,
    algorithm: str = "crc32",
) -> str | None:
    """Check this rank's share of the manifest's files (in parallel); return what is wrong."""
    mine = [(digest, path / name) for digest, name in entries if _owner(name, world_size) == rank]
    for _, file in mine:
        if not file.is_file():
            return f"{file} is missing (listed in the checksum manifest)"
    with ThreadPoolExecutor(writer_threads(), thread_name_prefix="dscale-checksum") as pool:
        actual = list(pool.map(lambda f: file_digest(f, algorithm), [f for _, f in mine]))
    for (digest, file), found in zip(mine, actual, strict=True):
        if found != digest:
            return (
                f"{file} is corrupt: {algorithm} {found[:16]} does not match "
                f"{digest[:16]} recorded in the manifest when it was saved"
            )
    return None
