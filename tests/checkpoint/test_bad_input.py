"""Bad input gets a named error and loses nothing: a full disk, a read-only folder, other formats.

The full disk is real where the tests run as root (a 1 MB tmpfs is mounted); a second test
simulates ENOSPC in the writer's stream, so that non-root machines test the same path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from dscale.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointSaveError,
    load_checkpoint,
)
from tests.checkpoint._helpers import make_model, make_scaler, params, train


class _Blob:
    """An extra state of a chosen size, to fill a disk."""

    def __init__(self, nbytes: int) -> None:
        self.data = torch.ones(nbytes // 4)

    def state_dict(self):
        return {"data": self.data}

    def load_state_dict(self, state_dict):
        self.data.copy_(state_dict["data"])


def _pieces():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = make_scaler()
    train(model, opt, scaler, 2)
    return model, opt, scaler


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], check=False)


def _assert_full_disk_handled(root: Path, exc: CheckpointSaveError, model, step_before: int):
    message = str(exc)
    assert "saving step 2" in message and "No space left on device" in message, message
    assert "needs about 4.2 MB" in message and "free" in message, message
    assert "previous checkpoints are kept" in message
    assert sorted(p.name for p in root.iterdir()) == [f"step-{step_before}"]  # no partial folder
    fresh = make_model(seed=9)
    assert load_checkpoint(root / f"step-{step_before}", model=fresh) == step_before
    for name, value in params(model).items():
        assert torch.equal(params(fresh)[name], value), name


@pytest.mark.skipif(not _can_mount(), reason="mounting a small tmpfs needs root")
def test_full_disk_keeps_previous_checkpoints_removes_the_partial_folder_and_says_what_it_needed(
    tmp_path,
):
    mount = tmp_path / "disk"
    _mount_tmpfs(mount, "1m")
    try:
        model, opt, scaler = _pieces()
        ckpt = CheckpointManager(mount, keep=2)
        ckpt.save(1, model=model, optimizer=opt, scaler=scaler)
        with pytest.raises(CheckpointSaveError) as info:
            ckpt.save(2, model=model, optimizer=opt, scaler=scaler, extra={"blob": _Blob(4 << 20)})
        assert "1.0 MB" not in str(info.value) or "free" in str(info.value)
        _assert_full_disk_handled(mount, info.value, model, 1)
    finally:
        _umount(mount)


def test_full_disk_simulated_in_the_writer_is_handled_the_same_way(tmp_path, monkeypatch):
    model, opt, scaler = _pieces()
    ckpt = CheckpointManager(tmp_path, keep=2)
    ckpt.save(1, model=model, optimizer=opt, scaler=scaler)
    real_stream = FileSystem.create_stream

    class _Disk:
        """The file as written to a disk with 1 MB left."""

        def __init__(self, raw) -> None:
            self.raw, self.left = raw, 1 << 20

        def write(self, data):
            self.left -= memoryview(data).nbytes
            if self.left < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        with real_stream(self, path, mode) as raw:
            yield _Disk(raw)

    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    with pytest.raises(CheckpointSaveError) as info:
        ckpt.save(2, model=model, optimizer=opt, scaler=scaler, extra={"blob": _Blob(4 << 20)})
    _assert_full_disk_handled(tmp_path, info.value, model, 1)


def test_read_only_checkpoint_folder_loads_but_refuses_to_save_naming_the_folder(tmp_path):
    model, opt, scaler = _pieces()
    if _can_mount():  # root ignores permissions: use a read-only mount
        root = tmp_path / "ro"
        _mount_tmpfs(root, "4m")
    else:
        root = tmp_path / "ro"
    try:
        CheckpointManager(root).save(1, model=model, optimizer=opt, scaler=scaler)
        if _can_mount():
            subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        else:
            root.chmod(0o555)
        fresh, fresh_opt, fresh_scaler = _pieces()
        ckpt = CheckpointManager(root)
        assert ckpt.resume("auto", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler) == 1
        with pytest.raises(CheckpointSaveError, match=r"is not writable: pass a checkpoint dir"):
            ckpt.save(2, model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
        assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    finally:
        if _can_mount():
            _umount(root)
        else:
            root.chmod(0o755)


def test_folders_of_other_formats_are_named_with_what_they_hold(tmp_path):
    model = make_model()
    cases = {}
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"{}")
    (hf / "config.json").write_text("{}")
    cases[hf] = r"hf is not a dscale checkpoint \(it holds a safetensors file"
    saved = tmp_path / "torch"
    saved.mkdir()
    torch.save(model.state_dict(), saved / "model.pt")
    cases[saved] = r"torch is not a dscale checkpoint \(it holds a torch\.save file"
    plain_dcp = tmp_path / "plain-dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=plain_dcp, no_dist=True)
    cases[plain_dcp] = r"plain-dcp is a DCP checkpoint without checksums\.crc32"
    CheckpointManager(tmp_path / "root").save(1, model=model)
    cases[tmp_path / "root"] = r"root is a checkpoint directory, not one checkpoint.*step-N"
    (tmp_path / "empty").mkdir()
    cases[tmp_path / "empty"] = r"empty is empty"
    before = params(model)
    for folder, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(folder, model=model)
        with pytest.raises(CheckpointError, match=message):
            CheckpointManager(tmp_path / "elsewhere").resume(folder, model=model)
    assert all(torch.equal(before[k], v) for k, v in params(model).items())


class _Buffer:
    def __init__(self, n: int) -> None:
        self.t = torch.arange(n, dtype=torch.float32)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t = state["t"]


def test_an_extra_of_another_shape_is_refused_before_dcp_reads_it(tmp_path):
    """The extra's own tensors bound what is read for it, as the model's do (before, DCP
    found the mismatch while loading, with 'Size mismatch ... (ranks [0])')."""
    CheckpointManager(tmp_path).save(1, model=make_model(), extra={"buf": _Buffer(8)})
    model, buffer = make_model(seed=5), _Buffer(4)
    before = params(model)
    with pytest.raises(CheckpointError, match=r"does not match extra\['buf'\]: buf\.t has shape"):
        load_checkpoint(tmp_path / "step-1", model=model, extra={"buf": buffer})
    assert torch.equal(buffer.t, torch.arange(4, dtype=torch.float32))
    assert all(torch.equal(before[k], v) for k, v in params(model).items())
