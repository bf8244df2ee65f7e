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


def deflated(tensor: torch.Tensor) -> bytes:
    """``torch.save(tensor)`` with its storage entry deflated, as torch.load still reads it."""
    import zipfile

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    src = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            packed = info.filename.endswith("/data/0")
            kind = zipfile.ZIP_DEFLATED if packed else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=kind)
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


def declare_huge(folder: Path, fqn: str, columns: int) -> int:
    """Make ``.metadata`` declare ``fqn`` (a [rows, n] tensor) with ``columns`` columns; reseal.

    The data files stay as they are, so the folder is small while the declared tensor is not,
    as an attacker who can rewrite ``.metadata`` and the manifest would make it. Returns the
    declared bytes.
    """
    metadata = SafeReader(folder).read_metadata()
    meta = metadata.state_dict_metadata[fqn]
    rows = meta.size[0]
    meta.size = torch.Size([rows, columns])
    for chunk in meta.chunks:
        chunk.sizes = torch.Size([chunk.sizes[0], columns])
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    reseal(folder)
    return rows * columns * meta.properties.dtype.itemsize


SPARSE = ("sparse_counter", "sparse_value", "sparse_metadata", "sparse_tail")
DIRECTORIES = ("dir_data", "dir_metadata", "dir_manifest", "dir_format")
DIRECTORY_FILES = ("__1_0.distcp", ".metadata", "checksums.crc32", "dscale.json")


def _rewrite(folder: Path, metadata) -> None:
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    reseal(folder)


def _move_to_a_hole(folder: Path, metadata, index: MetadataIndex, length: int):
    """Point ``index``'s record past the end of its file, ``length`` bytes of hole long."""
    info = metadata.storage_data.pop(index)
    file = folder / info.relative_path
    info.offset, info.length = file.stat().st_size, length
    os.truncate(file, info.offset + length)  # a hole: no block is written
    return info


def sparse_counter(folder: Path, fqn: str, nbytes: int) -> int:
    """The issue's edit: a 0-d int64 counter declared as ``nbytes``, backed by a hole; reseal."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = SafeReader(folder).read_metadata()
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    n = nbytes // 8
    meta = metadata.state_dict_metadata[fqn]
    meta.size = torch.Size([n])
    meta.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([n]))]
    info = _move_to_a_hole(folder, metadata, index, n * 8 + 4096)
    metadata.storage_data[MetadataIndex(fqn, torch.Size([0]))] = info
    _rewrite(folder, metadata)
    return n * 8


def sparse_value(folder: Path, fqn: str, nbytes: int) -> None:
    """A pickled value's record moved into a hole of ``nbytes``; reseal."""
    metadata = SafeReader(folder).read_metadata()
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    metadata.storage_data[index] = _move_to_a_hole(folder, metadata, index, nbytes)
    _rewrite(folder, metadata)


def sparse_metadata(folder: Path, nbytes: int) -> None:
    """A ``.metadata`` whose pickle opens a bytes value of ``nbytes``, all of it a hole."""
    head = b"\x80\x04\x8e" + nbytes.to_bytes(8, "little")  # PROTO 4, BINBYTES8 <n>
    file = folder / ".metadata"
    file.write_bytes(head)
    os.truncate(file, len(head) + nbytes)
    reseal(folder)


def sparse_tail(folder: Path, name: str, nbytes: int) -> None:
    """A data file extended by a hole after its last record; reseal."""
    file = folder / name
    os.truncate(file, file.stat().st_size + nbytes)
    reseal(folder)


def a_pickled_value(folder: Path, prefix: str) -> str:
    """The name of a value stored as pickled bytes (not a tensor) under ``prefix``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = SafeReader(folder).read_metadata()
    return next(
        fqn
        for fqn, meta in sorted(metadata.state_dict_metadata.items())
        if fqn.startswith(prefix) and isinstance(meta, BytesStorageMetadata)
    )


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hostile_folders_on_two_ranks(rank: int, world: int, root: str) -> dict:
    """Every rank loads folders with a FIFO, a symlink out, a huge declared tensor; saves
    through a symlinked leftover temp folder. Returns what each rank saw (errors as text)."""
    import shutil

    import torch.distributed as dist

    from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
    from tests.checkpoint._helpers import make_model, make_scaler, params

    base = Path(root)
    model = make_model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    ckpt = CheckpointManager(base / "good", keep=3)
    ckpt.save(2, model=model, optimizer=opt, scaler=scaler)
    ckpt.save(4, model=model, optimizer=opt, scaler=scaler)
    huge = 0
    if rank == 0:
        outside = base / "outside"
        outside.mkdir()
        for name in ("fifo", "symlink", "huge"):
            shutil.copytree(base / "good", base / name)
        os.unlink(base / "fifo" / "step-4" / "__1_0.distcp")
        os.mkfifo(base / "fifo" / "step-4" / "__1_0.distcp")
        shutil.move(base / "symlink" / "step-4" / "__1_0.distcp", outside / "__1_0.distcp")
        os.symlink(outside / "__1_0.distcp", base / "symlink" / "step-4" / "__1_0.distcp")
        # 8 rows of float32 weights declared as 8 x 8 Mi: 256 MiB from a folder of ~100 kB. (The
        # step's RNG rows declared so are refused earlier, by the shapes dscale writes.)
        huge = declare_huge(base / "huge" / "step-4", "model.0.weight", 8 << 20)
        (base / "good" / ".step-6.tmp").symlink_to(outside, target_is_directory=True)
        # Sparse files: 256 MiB declared, a few kB on disk (issue 33 item 3).
        for name in SPARSE + DIRECTORIES + ("hardlink",):
            shutil.copytree(base / "good" / "step-4", base / name / "step-4")
            shutil.copytree(base / "good" / "step-2", base / name / "step-2")
        sparse_counter(base / "sparse_counter" / "step-4", "train.step", 256 << 20)
        value = a_pickled_value(base / "sparse_value" / "step-4", "optimizer.")
        sparse_value(base / "sparse_value" / "step-4", value, 256 << 20)
        sparse_metadata(base / "sparse_metadata" / "step-4", 256 << 20)
        sparse_tail(base / "sparse_tail" / "step-4", "__1_0.distcp", 256 << 20)
        for name, file in zip(DIRECTORIES, DIRECTORY_FILES, strict=True):
            os.unlink(base / name / "step-4" / file)
            os.mkdir(base / name / "step-4" / file)
        # A hard link to a copy outside reads the same bytes: it loads.
        shutil.copy(base / "hardlink" / "step-4" / "__1_0.distcp", outside / "linked.distcp")
        os.unlink(base / "hardlink" / "step-4" / "__1_0.distcp")
        os.link(outside / "linked.distcp", base / "hardlink" / "step-4" / "__1_0.distcp")
        # A leftover temp folder whose files are hard links to a file outside: not written.
        (outside / "victim").write_bytes(b"not a checkpoint")
        (base / "good" / ".step-8.tmp").mkdir()
        for data in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
            os.link(outside / "victim", base / "good" / ".step-8.tmp" / data)
    dist.barrier()
    out: dict = {"huge_declared": huge, "saved": params(model)}
    for name in ("fifo", "symlink", "huge", *SPARSE, *DIRECTORIES, "hardlink"):
        fresh, fresh_opt, fresh_scaler = make_model(seed=7), None, make_scaler(init_scale=8.0)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        before, peak = params(fresh), _peak_rss_bytes()
        try:
            load_checkpoint(
                base / name / "step-4", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler
            )
            out[name] = None
        except CheckpointError as exc:
            out[name] = (type(exc).__name__, str(exc))
        out[f"{name}_rss_growth"] = _peak_rss_bytes() - peak
        out[f"{name}_loaded"] = params(fresh)
        out[f"{name}_unchanged"] = all(
            torch.equal(before[k], v) for k, v in params(fresh).items()
        ) and (fresh_scaler.get_scale() == 8.0)
        # resume("auto") goes on to the previous checkpoint, on every rank together.
        try:
            out[f"{name}_auto"] = CheckpointManager(base / name).resume(
                "auto", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler
            )
        except CheckpointError as exc:
            out[f"{name}_auto"] = (type(exc).__name__, str(exc))
    ckpt.save(6, model=model, optimizer=opt, scaler=scaler)
    step_6 = base / "good" / "step-6"
    out["step_6_is_symlink"] = step_6.is_symlink()
    out["outside_after_save"] = sorted(p.name for p in (base / "outside").iterdir())
    out["step_6_loads"] = load_checkpoint(step_6, model=make_model(seed=3))
    ckpt.save(8, model=model, optimizer=opt, scaler=scaler)
    out["victim_after_save"] = (base / "outside" / "victim").read_bytes()
    out["step_8_loads"] = load_checkpoint(base / "good" / "step-8", model=make_model(seed=3))
    return out


def overlapping(n_floats: int, copies: int) -> bytes:
    """A torch.save zip of ``copies`` float32 tensors of ``n_floats``, whose ``copies`` storage
    entries all point at one stored entry's bytes (the overlapping-files zip bomb): the record
    holds one storage, torch.load allocates ``copies``."""
    import struct
    import zipfile

    buffer = io.BytesIO()
    torch.save([torch.ones(n_floats) for _ in range(copies)], buffer)
    src = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    prefix = src.infolist()[0].filename.split("/")[0] + "/data/"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if not info.filename.startswith(prefix) or info.filename == prefix + "0":
                dst.writestr(info, src.read(info))
    data = out.getvalue()
    end = data.rfind(b"PK\x05\x06")
    directory_size, directory_at = struct.unpack("<II", data[end + 12 : end + 20])
    directory = data[directory_at : directory_at + directory_size]
    entries, pos = [], 0
    while pos < len(directory):
        name_len, extra_len, comment_len = struct.unpack("<HHH", directory[pos + 28 : pos + 34])
        size = 46 + name_len + extra_len + comment_len
        entries.append(directory[pos : pos + size])
        if directory[pos + 46 : pos + 46 + name_len].decode() == prefix + "0":
            first = directory[pos : pos + 46]
        pos += size
    for i in range(1, copies):  # the same local header, under another name
        name = f"{prefix}{i}".encode()
        entries.append(first[:28] + struct.pack("<HHH", len(name), 0, 0) + first[34:] + name)
    directory = b"".join(entries)
    tail = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), directory_at, 0
    )
    return data[:directory_at] + directory + tail
