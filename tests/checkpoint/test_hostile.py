"""No code runs from a checkpoint, whatever its bytes: a corpus of hostile pickles.

Each payload would create a marker file if it ran. They are planted into ``.metadata`` and into
the records of every value file of a 2-rank checkpoint, and the checksums are resealed, as an
attacker with write access to the folder would. Every load must be refused with an error naming
the file, leave the model as it was, and never create the marker.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from tests.checkpoint._helpers import make_model, make_scaler, params, reseal
from tests.checkpoint._hostile import _Reduce, corpus, plant, records_by_file, torch_saved

# torch.load notes protocols above 2 in the planted values; the refusal is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


def _fresh():
    model = make_model(seed=5)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), make_scaler(init_scale=8.0)


def test_the_corpus_runs_code_under_plain_pickle(tmp_path):
    """Control: the payloads are live, so the refusals below mean something."""
    marker = tmp_path / "ran"
    payloads = corpus(marker)
    assert len(payloads) == 8 * 6
    for name, payload in payloads.items():
        pickle.loads(payload)
        assert marker.exists(), f"control payload {name} did not run"
        marker.unlink()
    # ... and DCP's own reader runs the dotted-name attack from .metadata.
    folder = tmp_path / "ckpt"
    CheckpointManager(folder).save(1, model=make_model())
    (folder / "step-1" / ".metadata").write_bytes(payloads["dotted-global-p4"])
    with pytest.raises(Exception):  # noqa: B017, PT011 - the payload returns 0, not Metadata
        FileSystemReader(folder / "step-1").read_metadata()
    assert marker.exists()


def test_hostile_metadata_is_refused_naming_the_file_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    CheckpointManager(tmp_path / "ckpt").save(1, model=make_model())
    folder = tmp_path / "ckpt" / "step-1"
    real = (folder / ".metadata").read_bytes()
    model = make_model(seed=5)
    before = params(model)
    for name, payload in corpus(marker).items():
        (folder / ".metadata").write_bytes(payload)
        reseal(folder)
        with pytest.raises(CheckpointError, match=r"step-1/\.metadata cannot be read") as info:
            load_checkpoint(folder, model=model)
        assert not marker.exists(), f"{name} ran: {info.value}"
    assert all(torch.equal(before[k], v) for k, v in params(model).items())
    # A payload nested inside genuine metadata, at every protocol the writer can use.
    for protocol in range(2, 6):
        metadata = pickle.loads(real)
        metadata.planner_data = _Reduce(os.system, f"touch {marker}")
        (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))
        reseal(folder)
        with pytest.raises(CheckpointError, match=r"refusing to load posix\.system"):
            load_checkpoint(folder, model=model)
        assert not marker.exists()
        metadata.planner_data = pickle.loads(real).planner_data
        (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))
        reseal(folder)
        assert load_checkpoint(folder, model=model) == 1  # the allow-list is not too narrow


def test_hostile_values_in_every_value_file_are_refused_naming_the_file(
    saved_by_two_fsdp2_ranks, tmp_path
):
    root, _ = saved_by_two_fsdp2_ranks
    source = Path(root) / "good" / "step-3"
    marker = tmp_path / "ran"
    payloads = list(corpus(marker).items())
    by_file = records_by_file(source)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(by_file)  # a value file of each rank
    metadata = FileSystemReader(source).read_metadata()
    checked = 0
    for file_name, indexes in sorted(by_file.items()):
        kinds = {}
        for index in indexes:
            is_bytes = isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
            kinds.setdefault("bytes" if is_bytes else "tensor", index.fqn)
        for kind, fqn in sorted(kinds.items()):
            for number, (name, payload) in enumerate(payloads):
                folder = tmp_path / "work"
                shutil.rmtree(folder, ignore_errors=True)
                shutil.copytree(source, folder)
                wrapped = torch_saved(payload) if number % 2 else payload
                assert plant(folder, fqn, wrapped) == file_name
                model, opt, scaler = _fresh()
                before = params(model)
                with pytest.raises(CheckpointError, match=rf"work/{file_name} holds a value"):
                    load_checkpoint(folder, model=model, optimizer=opt, scaler=scaler)
                assert not marker.exists(), f"{name} in {kind} record {fqn} ran"
                assert all(torch.equal(before[k], v) for k, v in params(model).items())
                assert scaler.get_scale() == 8.0
                checked += 1
    assert checked >= 2 * len(payloads) * 2 - len(payloads)  # both files, tensor and byte records
