"""Checksums computed where the bytes are: each rank hashes the files it wrote, or a share to read.

On save, every rank hashes its own ``__<rank>_*.distcp`` files right after writing them (in
parallel across ranks, and inside DCP's write step, so async saves hash in the background too).
The digests travel to the coordinator with DCP's write results, and the coordinator only adds
``.metadata`` and ``dscale.json`` and writes the manifest. On load, each rank hashes its share
of the files while DCP reads, and nothing is applied before every share has checked out.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dscale.checkpoint._layout import FORMAT_FILE, MANIFEST, format_json

__all__ = ["HashingWriter", "sha256_file", "verify_share"]

_CHUNK = 8 << 20
_DIGEST_KEY = "__dscale_sha256__/"


def sha256_file(file: Path) -> str:
    """The file's sha256 as hex; hashlib releases the GIL, so ranks' threads overlap with I/O."""
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(file: Path, text: str) -> None:
    with file.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, plus per-rank file hashes and a manifest written by the coordinator.

    The manifest (``checksums.sha256``) is written last, after ``.metadata``: a folder holding
    it has every rank's data.
    """

    def __init__(self, path: Path, *, step: int, world_size: int) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True
        )
        self._format = format_json(step, world_size)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = super().write_data(plan, planner).wait()
        names = sorted({r.storage_data.relative_path for r in results})
        digests = [
            WriteResult(
                index=MetadataIndex(_DIGEST_KEY + name),
                size_in_bytes=0,
                storage_data=sha256_file(Path(self.path) / name),
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
        for name in (".metadata", FORMAT_FILE):
            digests[name] = sha256_file(folder / name)
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
    path: Path, entries: Iterable[tuple[str, str]], rank: int, world_size: int
) -> str | None:
    """Check this rank's share of the manifest's files; return what is wrong, or None."""
    for digest, name in entries:
        if _owner(name, world_size) != rank:
            continue
        file = path / name
        if not file.is_file():
            return f"{file} is missing (listed in {MANIFEST})"
        actual = sha256_file(file)
        if actual != digest:
            return (
                f"{file} is corrupt: sha256 {actual[:16]}... does not match "
                f"{digest[:16]}... recorded in {MANIFEST} when it was saved"
            )
    return None
