"""Bad input: missing, corrupt, truncated, another model's, or booby-trapped checkpoints."""

from __future__ import annotations

import logging
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dscale.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    load_checkpoint,
)
from dscale.checkpoint._layout import MANIFEST
from tests.checkpoint._helpers import make_model, make_scaler, params, reseal, train


def _saved(tmp_path, steps=(2, 4)):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = make_scaler()
    ckpt = CheckpointManager(tmp_path, keep=3)
    for s in steps:
        train(model, opt, scaler, 2)
        ckpt.save(s, model=model, optimizer=opt, scaler=scaler)
    return model, opt, scaler


def _fresh(hidden=8):
    model = make_model(seed=5, hidden=hidden)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), make_scaler()


def _flip_byte(file: pathlib.Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


_reseal = reseal


def _truncate(file: pathlib.Path) -> None:
    file.write_bytes(file.read_bytes()[:-100])


@pytest.mark.parametrize("damage", [_flip_byte, _truncate], ids=["flipped_byte", "truncated"])
def test_damaged_data_file_is_detected_and_auto_resume_falls_back(tmp_path, caplog, damage):
    _saved(tmp_path)
    damage(tmp_path / "step-4" / "__0_0.distcp")
    model, opt, scaler = _fresh()

    # A truncated file is refused before DCP opens it, by its size; a flipped byte by its CRC32.
    said = r"step-4/__0_0\.distcp is corrupt: (crc32|truncated to)"
    with pytest.raises(CorruptCheckpointError, match=said):
        load_checkpoint(tmp_path / "step-4", model=model, optimizer=opt, scaler=scaler)
    with caplog.at_level(logging.WARNING, logger="dscale.checkpoint"):
        step = CheckpointManager(tmp_path).resume("auto", model=model, optimizer=opt, scaler=scaler)

    assert step == 2
    assert "skipping checkpoint step 4" in caplog.text
    assert "__0_0.distcp is corrupt" in caplog.text


def test_truncated_metadata_is_reported_with_its_file_name(tmp_path):
    _saved(tmp_path, steps=(2,))
    meta = tmp_path / "step-2" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(CorruptCheckpointError, match=r"step-2/\.metadata is corrupt"):
        load_checkpoint(tmp_path / "step-2", model=_fresh()[0])
    _reseal(tmp_path / "step-2")  # checksums now match the truncated file
    with pytest.raises(CheckpointError, match=r"step-2/\.metadata cannot be read"):
        load_checkpoint(tmp_path / "step-2", model=_fresh()[0])


def test_missing_folder_and_unpublished_folder_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope/step-3 does not exist"):
        load_checkpoint(tmp_path / "nope" / "step-3", model=_fresh()[0])
    (tmp_path / "scaler.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"scaler\.pt is a file.*load_scaler_file"):
        CheckpointManager(tmp_path).resume(tmp_path / "scaler.pt", model=_fresh()[0])
    _saved(tmp_path, steps=(2,))
    (tmp_path / "step-2" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"step-2 is a DCP checkpoint without checksums"):
        load_checkpoint(tmp_path / "step-2", model=_fresh()[0])


def test_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path):
    _saved(tmp_path, steps=(2,))
    bigger, opt, scaler = _fresh(hidden=16)
    before = params(bigger)
    with pytest.raises(CheckpointError, match=r"step-2 .*Size mismatch|step-2 does not match"):
        load_checkpoint(tmp_path / "step-2", model=bigger, optimizer=opt, scaler=scaler)

    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(CheckpointError, match=r"step-2 does not match the model.*another model"):
        load_checkpoint(tmp_path / "step-2", model=other)
    assert all(torch.equal(before[k], v) for k, v in params(bigger).items())


class _Touch:
    """Unpickling this creates a file: a stand-in for arbitrary code."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class _Holder:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state_dict):
        self.value = state_dict["value"]


def test_pickled_payload_in_a_value_does_not_run_on_load(tmp_path):
    marker = tmp_path / "payload-ran"
    model = make_model()
    CheckpointManager(tmp_path).save(1, model=model, extra={"notes": _Holder(_Touch(marker))})
    assert not marker.exists()

    refused = r"step-1 failed: .*(Unsupported global|Weights only)"
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(tmp_path / "step-1", model=model, extra={"notes": _Holder(None)})
    assert not marker.exists()
    # Control: DCP's default planner runs the payload, so the test above can fail.
    dcp.load(
        {"notes": _Holder(None)}, storage_reader=FileSystemReader(tmp_path / "step-1"), no_dist=True
    )
    assert marker.exists()


def test_pickled_payload_in_metadata_does_not_run_on_load(tmp_path):
    marker = tmp_path / "payload-ran"
    _saved(tmp_path, steps=(2,))
    meta_file = tmp_path / "step-2" / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())
    metadata.planner_data = _Touch(marker)
    meta_file.write_bytes(pickle.dumps(metadata))
    _reseal(tmp_path / "step-2")

    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read .*refusing to load"):
        load_checkpoint(tmp_path / "step-2", model=_fresh()[0])
    assert not marker.exists()


def test_a_version_1_checkpoint_with_a_sha256_manifest_still_loads_and_is_verified(tmp_path):
    """Folders written before dscale.json and CRC32 (format version 1) keep working."""
    import hashlib

    model, _, _ = _saved(tmp_path, steps=(2,))
    folder = tmp_path / "step-2"
    (folder / "dscale.json").unlink()
    (folder / "checksums.crc32").unlink()
    lines = [
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
        for f in sorted(folder.iterdir())
    ]
    (folder / "checksums.sha256").write_text("".join(lines))
    fresh = _fresh()[0]
    assert CheckpointManager(tmp_path).resume("auto", model=fresh) == 2
    assert all(torch.equal(params(model)[k], v) for k, v in params(fresh).items())
    _flip_byte(folder / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is corrupt: sha256"):
        load_checkpoint(folder, model=fresh)
