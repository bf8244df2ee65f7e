"""Every check runs before anything changes: after each refused load, everything is as before.

"Everything" is the model's parameters, the optimizer's state, the scaler's state dict, an
extra Stateful, and the torch and Python RNG states. Each refusal below is one way a checkpoint
can be rejected; the oracle is a snapshot taken before the call.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from dscale.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    ScaleMismatchError,
    load_checkpoint,
)
from tests.checkpoint._helpers import make_model, make_scaler, optim_state, params, reseal, train
from tests.checkpoint._hostile import plant


class _Counter:
    def __init__(self, value: int) -> None:
        self.value = torch.tensor([value])

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state_dict):
        self.value.copy_(state_dict["value"])


def _pieces(seed: int, hidden: int = 8):
    model = make_model(seed=seed, hidden=hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make_scaler(init_scale=8.0)
    train(model, opt, scaler, 2, seed=seed)
    return {"model": model, "optimizer": opt, "scaler": scaler, "extra": {"c": _Counter(seed)}}


def _snapshot(p) -> dict:
    return {
        "params": params(p["model"]),
        "optim": optim_state(p["model"], p["optimizer"]),
        "scaler": p["scaler"].state_dict(),
        "extra": p["extra"]["c"].value.clone(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }


def _same(a: dict, b: dict) -> bool:
    torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
    torch.testing.assert_close(a["optim"], b["optim"], rtol=0, atol=0)
    return (
        a["scaler"] == b["scaler"]
        and torch.equal(a["extra"], b["extra"])
        and torch.equal(a["torch_rng"], b["torch_rng"])
        and a["python_rng"] == b["python_rng"]
    )


def _flip(folder: Path) -> None:
    file = folder / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _newer_format(folder: Path) -> None:
    info = json.loads((folder / "dscale.json").read_text())
    (folder / "dscale.json").write_text(json.dumps({**info, "version": 99}))
    reseal(folder)


def _scaler_rejects(folder: Path) -> None:
    buffer = io.BytesIO()
    torch.save(torch.tensor(0.5, dtype=torch.float64), buffer)  # growth_factor must be > 1
    plant(folder, "scaler.values.growth_factor", buffer.getvalue())


def _missing_data(folder: Path) -> None:
    (folder / "__0_0.distcp").unlink()


REFUSALS = {
    "flipped_byte": (_flip, CorruptCheckpointError, r"__0_0\.distcp is corrupt"),
    "missing_file": (_missing_data, CorruptCheckpointError, r"__0_0\.distcp is missing"),
    "newer_format": (_newer_format, CheckpointError, r"format version 99"),
    "scaler_rejects_values": (_scaler_rejects, CheckpointError, r"growth_factor"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    p = _pieces(seed=0)
    torch.manual_seed(42)
    CheckpointManager(root).save(2, **p)
    return root / "step-2"


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_refused_load_leaves_model_optimizer_scaler_extra_and_rng_unchanged(
    saved, tmp_path, refusal
):
    damage, error, message = REFUSALS[refusal]
    folder = tmp_path / "step-2"
    shutil.copytree(saved, folder)
    damage(folder)
    p = _pieces(seed=3)
    torch.manual_seed(7)
    before = _snapshot(p)
    with pytest.raises(error, match=message):
        load_checkpoint(folder, **p)
    assert _same(_snapshot(p), before)
    # Control: the undamaged checkpoint does change all of it.
    load_checkpoint(saved, **p)
    with pytest.raises(AssertionError):
        _same(_snapshot(p), before)


def test_checkpoint_of_another_model_shape_is_refused_before_anything_changes(saved):
    p = _pieces(seed=3, hidden=16)
    before = _snapshot(p)
    shape = r"does not match the model: model\.0\.bias has shape \(8,\) there and \(16,\)"
    with pytest.raises(CheckpointError, match=shape):
        load_checkpoint(saved, **p)
    assert _same(_snapshot(p), before)


def test_saved_scale_disagreement_is_refused_before_the_model_changes(saved_by_two_fsdp2_ranks):
    """A 2-rank checkpoint whose ranks saved different scales, loaded on 1 rank (another world
    size): the error names each saving rank's value."""
    root, results = saved_by_two_fsdp2_ranks
    p = _pieces(seed=3)
    before = _snapshot(p)
    scale = results[0]["reference"]["scaler"]["scale"]
    names = rf"scale differs between the saving ranks \(rank 0: {scale:g}, rank 1: {scale / 2:g}\)"
    with pytest.raises(ScaleMismatchError, match=names):
        load_checkpoint(Path(root) / "split" / "step-4", **{**p, "extra": None})
    assert _same(_snapshot(p), before)
    for rank in (0, 1):  # the same on 2 ranks, for the scale and the corrupt shard
        assert results[rank]["unchanged_after_refusals"], f"rank {rank} changed its model"
