"""Read DCP checkpoints without running code from their bytes.

DCP's default reader unpickles ``.metadata`` with ``pickle.load`` and its default planner loads
every non-tensor value with ``torch.load(weights_only=False)``, so a planted ``__reduce__`` runs
on every rank (pytorch/pytorch#189308; DCP assumes a trusted environment). Here:

* ``.metadata`` goes through an unpickler that resolves exact ``(module, name)`` pairs only, the
  globals torch 2.13's FileSystemWriter writes, and refuses dotted names (protocol 4 resolves
  ``os.system`` inside any allowed module). The result is then checked to be DCP metadata whose
  storage entries name plain files of the folder, stored through no transform (DCP would
  decompress a ``stream.zstd`` record where zstandard is installed, unbounded by the disk bytes).
* values go through ``torch.load(weights_only=True)``, tensors and non-tensors alike, after
  their zip is checked to be stored as torch.save writes it (no inflating past the disk bytes).
* every refusal is a CheckpointError naming the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
import zipfile
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from dscale.checkpoint._errors import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "SafeLoadPlanner", "SafeReader", "load_scaler_file", "read_metadata"]

_DTYPES = {name: v for name in dir(torch) if isinstance(v := getattr(torch, name), torch.dtype)}

# Exactly the globals in .metadata files written by torch 2.13 (pickle protocols 2 to 5).
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # how Python 3.13 pickles it
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}

# What DCP's FileSystemWriter names its data files: __<rank>_<n>.distcp
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves exact (module, name) pairs from ALLOWED_GLOBALS; nothing is imported."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: not a checkpoint metadata type"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id: not a checkpoint metadata type")


def _check_metadata(metadata: Any) -> Metadata:
    """Raise ValueError unless ``metadata`` is DCP Metadata naming plain files of the folder."""
    if not isinstance(metadata, Metadata):
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError("state_dict_metadata is not a dict")
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(
            meta, TensorStorageMetadata | BytesStorageMetadata
        ):
            raise ValueError(f"entry {key!r} is a {type(meta).__name__}, not storage metadata")
    if not isinstance(metadata.storage_data, dict):
        raise ValueError("storage_data is not a dict")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise ValueError(f"storage entry {index!r} is not a DCP storage record")
        if not isinstance(info.relative_path, str) or not DATA_FILE.match(info.relative_path):
            raise ValueError(
                f"storage entry {index.fqn!r} points at {info.relative_path!r}, "
                "not a __<rank>_<n>.distcp file of this folder"
            )
        if info.transform_descriptors:
            # DCP would decompress it (stream.zstd, where zstandard or pyzstd is installed):
            # an allocation that the bytes on disk do not bound, and no check of its zip.
            raise ValueError(
                f"storage entry {index.fqn!r} is stored through the transforms "
                f"{list(info.transform_descriptors)!r}, and dscale.checkpoint writes none"
            )
    return metadata


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata and values cannot run code; errors name the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _check_metadata(_MetadataUnpickler(stream).load())
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reader loop, one file at a time, so that a refused value names its file.

        A loaded tensor that fills a whole plain CPU target is adopted instead of copied (see
        SafeLoadPlanner.adopt): the empty copies we load into are then never touched.
        """
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            path = pathlib.Path(self.path) / relative_path
            try:
                self._read_file(path, items, planner)
            except Exception as exc:
                raise CheckpointError(
                    f"{path} holds a value that cannot be loaded as plain data "
                    f"({type(exc).__name__}: {exc}); nothing was changed"
                ) from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, path: pathlib.Path, items: list[ReadItem], planner: LoadPlanner) -> None:
        with self.fs.create_stream(path, "rb") as stream:
            for item in items:
                info = self.storage_data[item.storage_index]
                # As torch.save wrote it: a zip (_check_metadata refused any transform).
                check_stored(_Window(stream, info.offset, info.length), info.length)
                raw = self.transforms.transform_load_stream(
                    item, info.transform_descriptors or (), self._slice_file(stream, info)
                )
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(raw.read(-1)))
                    continue
                seekable = raw if raw.seekable() else io.BytesIO(raw.read(-1))
                loaded = torch.load(seekable, map_location="cpu", weights_only=True)
                if not isinstance(loaded, torch.Tensor):
                    raise TypeError(f"a tensor record holds a {type(loaded).__name__}")
                tensor = narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths)
                if isinstance(planner, SafeLoadPlanner) and planner.adopt(item, tensor):
                    continue
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"size {tuple(tensor.size())} != {tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a file, seekable from either end.

    DCP's own view (``_ReaderView``) seeks past the end for ``seek(-n, SEEK_END)``, which is
    how zipfile finds a zip's directory.
    """

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._pos = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(base + offset, self._length))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._stream.seek(self._offset + self._pos)
        got = int(self._stream.readinto(memoryview(buffer)[:n]))
        self._pos += got
        return got


def check_stored(record: Any, length: int) -> None:
    """Raise ValueError unless every entry of a record's zip is stored, inside the record.

    torch.save stores its entries uncompressed, but torch.load also inflates compressed ones:
    a 260 kB record could unpack a 256 MiB storage behind a tensor of the model's shape, an
    allocation the bytes on disk do not bound. Entries together must fit in the record too:
    a directory whose entries all point at the same stored bytes (a 1 MB record naming 300
    storages) made torch.load allocate 300 MB. Only the zip's directory is read.
    """
    try:
        with zipfile.ZipFile(record) as archive:
            total = 0
            for entry in archive.infolist():
                if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > length:
                    raise ValueError(
                        f"its entry {entry.filename} unpacks {entry.compress_size} bytes to "
                        f"{entry.file_size} (compression {entry.compress_type}); torch.save "
                        "writes every entry stored, as it is"
                    )
                total += entry.file_size
                if total > length:
                    raise ValueError(
                        f"its entries up to {entry.filename} hold {total} bytes, more than the "
                        f"record's {length}: they overlap, which torch.save never writes"
                    )
    except zipfile.BadZipFile as exc:
        raise ValueError(f"it is not a torch.save record ({exc})") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """A DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``.

    Used only with staged state dicts (fresh empty tensors, see ``_staging.py``), so a loaded
    tensor may replace its target instead of being copied into it.
    """

    def adopt(self, item: ReadItem, tensor: torch.Tensor) -> bool:
        """Put ``tensor`` in place of a whole plain CPU target of the same shape and dtype."""
        target = self.state_dict.get(item.dest_index.fqn)  # not a DTensor's local shard
        if not isinstance(target, torch.Tensor):
            return False
        whole = all(o == 0 for o in item.dest_offsets) and tuple(item.lengths) == tuple(
            target.shape
        )
        if not (
            whole
            and type(target) is torch.Tensor
            and target.device.type == "cpu"
            and tensor.dtype == target.dtype
            and tensor.shape == target.shape
        ):
            return False
        fqn = item.dest_index.fqn
        if self.flatten_state_dict and not _replace_leaf(
            self.original_state_dict, self.mappings[fqn], target, tensor
        ):
            return False
        self.state_dict[fqn] = tensor
        return True

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _replace_leaf(root: Any, path: tuple[Any, ...], old: torch.Tensor, new: torch.Tensor) -> bool:
    """Put ``new`` where ``old`` sits at ``path``; False if it is not there.

    DCP's flattened paths hold dict keys as strings ('0' for an optimizer's int key 0), so
    each step accepts either form.
    """
    node = root
    for i, key in enumerate(path):
        if isinstance(node, dict):
            if key not in node and isinstance(key, str) and key.isdigit():
                key = int(key)
            if key not in node:
                return False
        elif isinstance(node, list):
            key = int(key)
            if not 0 <= key < len(node):
                return False
        else:
            return False
        if i == len(path) - 1:
            if node[key] is not old:
                return False
            node[key] = new
            return True
        node = node[key]
    return False


def read_metadata(path: pathlib.Path) -> Metadata:
    """The checkpoint's ``.metadata``, read safely; a CheckpointError names the file if not."""
    file = path / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a complete DCP checkpoint")
    try:
        return SafeReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"{file} cannot be read as checkpoint metadata ({type(exc).__name__}: {exc}); "
            "nothing was loaded"
        ) from exc


def load_scaler_file(scaler: Any, path: str | pathlib.Path) -> None:
    """Load a scaler state dict saved with ``torch.save(scaler.state_dict(), path)``.

    This is how a ``torch.amp.GradScaler`` state is usually stored. It loads with
    ``weights_only=True``, so a file holding anything but plain values is refused, and its zip
    must be stored as torch.save writes it (a few kB could otherwise inflate to GiB).

    Raises:
        CheckpointError: the file is missing, unreadable, or not a scaler state dict.
    """
    file = pathlib.Path(path)
    if not file.is_file():
        raise CheckpointError(
            f"scaler state file {file} does not exist; pass the path of a "
            "file written by torch.save(scaler.state_dict(), path)"
        )
    try:
        if zipfile.is_zipfile(file):  # torch.save's format since torch 1.6
            with file.open("rb") as stream:
                check_stored(stream, file.stat().st_size)
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{file} cannot be loaded as a scaler state dict ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(state, dict) or "scale" not in state:
        raise CheckpointError(
            f"{file} is not a GradScaler state dict (no 'scale' key); "
            "it should come from torch.save(scaler.state_dict(), path)"
        )
    scaler.load_state_dict(state)
