"""Load DCP checkpoints without running pickled code.

DCP's default reader unpickles ``.metadata`` with ``pickle.load`` and its default planner loads
every non-tensor value with ``torch.load(weights_only=False)``, so a planted ``__reduce__`` runs
on every rank (pytorch/pytorch#189308; DCP assumes a trusted environment). Here the metadata goes
through an unpickler that only knows DCP's metadata classes, and values go through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from dscale.checkpoint._errors import CheckpointError

__all__ = ["SafeLoadPlanner", "SafeReader", "load_scaler_file", "read_metadata"]

# The globals found in real .metadata files written by torch 2.13's FileSystemWriter.
_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata classes, torch dtypes and a few plain types."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, torch.dtype | torch.memory_format):
            return value
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: not a checkpoint metadata type"
        )


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata unpickler refuses anything but DCP metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP Metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """A DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: pathlib.Path) -> Metadata:
    """The checkpoint's ``.metadata``, read safely; a CheckpointError names the file if not."""
    file = path / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a complete DCP checkpoint")
    try:
        return SafeReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc})") from exc


def load_scaler_file(scaler: Any, path: str | pathlib.Path) -> None:
    """Load a scaler state dict saved with ``torch.save(scaler.state_dict(), path)``.

    This is how a ``torch.amp.GradScaler`` state is usually stored. It loads with
    ``weights_only=True``, so a file holding anything but plain values is refused.

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
