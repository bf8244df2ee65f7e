"""A corpus of hostile pickles, and a way to plant one into a checkpoint folder.

Every payload, if it ran, would create ``marker`` (by a shell command, a subprocess, or exec).
The tests load checkpoints carrying them and check that the marker never appears.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import subprocess
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dscale.checkpoint._safe_io import SafeReader
from tests.checkpoint._helpers import reseal


class _Reduce:
    """Pickles as a call of ``func(*args)``: the classic REDUCE payload."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _proto(p: int) -> bytes:
    return bytes([0x80, p]) if p >= 2 else b""


def _string(text: str, p: int) -> bytes:
    """A string on the stack, in an opcode that protocol ``p`` knows."""
    if p == 0:
        return b"V" + text.encode() + b"\n"  # UNICODE
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _global(module: str, name: str, p: int) -> bytes:
    if p >= 4:  # STACK_GLOBAL, how protocol 4 resolves dotted names
        return _string(module, p) + _string(name, p) + b"\x93"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def corpus(marker: Path) -> dict[str, bytes]:
    """``{name: pickle bytes}`` for every payload kind in protocols 0 to 5."""
    shell = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    out: dict[str, bytes] = {}
    for p in range(6):
        out[f"os.system-reduce-p{p}"] = pickle.dumps(_Reduce(os.system, shell), protocol=p)
        out[f"builtins.exec-reduce-p{p}"] = pickle.dumps(_Reduce(builtins.exec, code), protocol=p)
        out[f"subprocess-reduce-p{p}"] = pickle.dumps(
            _Reduce(subprocess.check_call, ["touch", str(marker)]), protocol=p
        )
        # The attack from the issue: an allowed module, a dotted name reaching os.system.
        # (Dotted names resolve once a PROTO 4 header is seen, whichever opcode names them.)
        dotted = _global("torch.distributed.checkpoint.metadata", "os.system", p)
        call = dotted + b"(" + _string(shell, p) + b"tR."
        out[f"dotted-global-p{p}"] = _proto(max(p, 4)) + call
        builtin = _global("builtins", "eval", p)
        out[f"builtins.eval-p{p}"] = _proto(p) + builtin + b"(" + _string(code, p) + b"tR."
        # INST: module and name inline, arguments from the mark; OBJ: class from the stack.
        out[f"inst-p{p}"] = _proto(p) + b"(" + _string(shell, p) + b"ios\nsystem\n."
        out[f"obj-p{p}"] = _proto(p) + b"(" + _global("os", "system", p) + _string(shell, p) + b"o."
        # BUILD: state set on the result of a disallowed call.
        run = _global("subprocess", "run", p) + b"((" + _string("touch", p)
        out[f"build-p{p}"] = _proto(p) + run + _string(str(marker), p) + b"ltR}b."
    return out


def torch_saved(obj_bytes: bytes) -> bytes:
    """The payload inside a torch.save zip, as DCP stores values (data.pkl is the pickle)."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1), buffer)
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = obj_bytes if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, data)
    return out.getvalue()


def plant(folder: Path, fqn: str, payload: bytes) -> str:
    """Replace the stored bytes of ``fqn`` with ``payload``; reseal; return the file's name."""
    metadata = SafeReader(folder).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    file = folder / info.relative_path
    data = file.read_bytes()
    file.write_bytes(data[: info.offset] + payload + data[info.offset + info.length :])
    delta = len(payload) - info.length
    for other_info in metadata.storage_data.values():
        if other_info.relative_path == info.relative_path and other_info.offset > info.offset:
            other_info.offset += delta
    info.length = len(payload)
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    reseal(folder)
    return info.relative_path


def records_by_file(folder: Path) -> dict[str, list[MetadataIndex]]:
    metadata = SafeReader(folder).read_metadata()
    out: dict[str, list[MetadataIndex]] = {}
    for index, info in metadata.storage_data.items():
        out.setdefault(info.relative_path, []).append(index)
    return out
