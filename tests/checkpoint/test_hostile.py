"""No code runs from a checkpoint, whatever its bytes: a corpus of hostile pickles.

Each payload would create a marker file if it ran. They are planted into ``.metadata`` and into
the records of every value file of a 2-rank checkpoint, and the checksums are resealed, as an
attacker with write access to the folder would. Every load must be refused with an error naming
the file, leave the model as it was, and never create the marker.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from tests.checkpoint._helpers import make_model, make_scaler, params, reseal
from tests.checkpoint._hostile import (
    _Reduce,
    corpus,
    deflated,
    hostile_folders_on_two_ranks,
    overlapping,
    plant,
    records_by_file,
    torch_saved,
)
from tests.multirank import run_ranks

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


@pytest.fixture(scope="module")
def hostile_folders(tmp_path_factory):
    """One 2-rank spawn: a FIFO, a symlink out, a huge declared tensor, a symlinked temp,
    sparse files, folders in place of files, hard links."""
    root = str(tmp_path_factory.mktemp("hostile-folders"))
    return run_ranks(
        hostile_folders_on_two_ranks, root, world_size=2, timeout_s=120, pg_timeout_s=60
    )


@pytest.mark.parametrize(
    ("folder", "said"),
    [
        ("fifo", r"step-4/__1_0\.distcp is a FIFO \(named pipe\), not a regular file"),
        (
            "symlink",
            r"step-4/__1_0\.distcp is a symlink to .*outside/__1_0\.distcp, outside the checkpoint",
        ),
    ],
)
def test_a_fifo_or_symlink_out_in_a_checkpoint_is_refused_on_every_rank_before_dcp_opens_it(
    hostile_folders, folder, said
):
    """Before, DCP opened the FIFO and every rank hung (the checksum thread had called it
    missing); the spawn's timeout is what failed."""
    for rank in (0, 1):
        kind, message = hostile_folders[rank][folder]
        assert kind == "CorruptCheckpointError", message
        assert re.search(said, message), message
        assert hostile_folders[rank][f"{folder}_unchanged"]
        assert hostile_folders[rank][f"{folder}_auto"] == 2  # the previous checkpoint
    assert hostile_folders[0][folder] == hostile_folders[1][folder]


def test_metadata_declaring_a_huge_tensor_is_refused_before_anything_is_allocated(
    hostile_folders,
):
    """A ~100 kB folder whose resealed .metadata declares 256 MiB: refused against the bytes
    on disk. Before, every rank allocated the declared size before any data was checked."""
    assert hostile_folders[0]["huge_declared"] == 256 << 20
    for rank in (0, 1):
        kind, message = hostile_folders[rank]["huge"]
        assert kind == "CorruptCheckpointError", message
        assert "declares 'model.0.weight' as (8, 8388608)" in message, message
        assert "not the bytes on disk" in message
        growth = hostile_folders[rank]["huge_rss_growth"]
        assert growth < 64 << 20, f"rank {rank}'s peak memory grew by {growth} bytes"
        assert hostile_folders[rank]["huge_unchanged"]
        assert hostile_folders[rank]["huge_auto"] == 2


def test_a_symlinked_leftover_temp_folder_is_replaced_not_written_through(hostile_folders):
    """Before, the save wrote into the symlink's target and published the symlink as step-6."""
    for rank in (0, 1):
        assert not hostile_folders[rank]["step_6_is_symlink"]
        assert hostile_folders[rank]["outside_after_save"] == [
            "__1_0.distcp",
            "linked.distcp",
            "victim",
        ]
        assert hostile_folders[rank]["step_6_loads"] == 6


@pytest.mark.parametrize(
    ("folder", "said"),
    [
        (  # the edit: refused by the shape dscale writes, before the disk is asked
            "sparse_counter",
            r"step-4/\.metadata declares 'train\.step' as \(33554432,\) torch\.int64 "
            r"\(268435456 bytes\), but dscale\.checkpoint writes it as a 0-d int64 counter",
        ),
        (
            "sparse_value",
            r"step-4/__\d_0\.distcp is a sparse file: \d+ bytes of the record of "
            r"'optimizer\.[^']+' \(a pickled value\) are holes, not on disk",
        ),
        ("sparse_metadata", r"step-4/\.metadata is a sparse file: \d{9} bytes of the file"),
        ("sparse_tail", r"step-4/__1_0\.distcp is a sparse file: \d{9} bytes of no record"),
    ],
)
def test_a_sparse_file_is_refused_on_every_rank_before_anything_is_allocated(
    hostile_folders, folder, said
):
    """256 MiB declared and backed by a hole: a few kB on disk. Before, the counter, the pickled
    value and the .metadata were each read as 256 MiB of zeros (peak RSS +256 MiB on every
    rank) before a refusal; the hole after the last record loaded (and was hashed)."""
    for rank in (0, 1):
        growth = hostile_folders[rank][f"{folder}_rss_growth"]
        assert growth < 64 << 20, f"rank {rank}'s peak memory grew by {growth} bytes"
        result = hostile_folders[rank][folder]
        assert result is not None, f"rank {rank} loaded {folder}"
        kind, message = result
        assert kind == "CorruptCheckpointError", message
        assert re.search(said, message), message
        assert hostile_folders[rank][f"{folder}_unchanged"]
        assert hostile_folders[rank][f"{folder}_auto"] == 2  # the previous checkpoint
    assert hostile_folders[0][folder] == hostile_folders[1][folder]


@pytest.mark.parametrize(
    ("folder", "file"),
    [
        ("dir_data", "__1_0.distcp"),
        ("dir_metadata", ".metadata"),
        ("dir_manifest", "checksums.crc32"),
        ("dir_format", "dscale.json"),
    ],
)
def test_a_folder_in_place_of_a_checkpoint_file_is_refused_naming_it(hostile_folders, folder, file):
    """Before, a folder in place of the manifest read as 'not written by dscale.checkpoint',
    a plain CheckpointError, so resume('auto') stopped instead of going back a checkpoint."""
    for rank in (0, 1):
        kind, message = hostile_folders[rank][folder]
        assert kind == "CorruptCheckpointError", message
        assert f"step-4/{file} is a folder, not a regular file" in message, message
        assert hostile_folders[rank][f"{folder}_unchanged"]
        assert hostile_folders[rank][f"{folder}_auto"] == 2


def test_a_hard_linked_data_file_loads_the_same_values_and_a_save_never_writes_through_one(
    hostile_folders,
):
    """A hard link reads the checked bytes of a copy (oracle: the model as saved); a leftover
    temp folder of hard links to a file outside is removed, not written into."""
    for rank in (0, 1):
        out = hostile_folders[rank]
        assert out["hardlink"] is None
        saved, loaded = out["saved"], out["hardlink_loaded"]
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
        assert out["hardlink_auto"] == 4
        assert out["victim_after_save"] == b"not a checkpoint"
        assert out["step_8_loads"] == 8


def test_a_record_inflating_past_its_bytes_on_disk_is_refused(tmp_path):
    """A 0.3 MB record whose deflated storage entry unpacks to 256 MiB behind a view of the
    weight's shape: before, torch.load allocated the 256 MiB and the load succeeded (zeros)."""
    CheckpointManager(tmp_path / "ckpt").save(1, model=make_model())
    folder = tmp_path / "ckpt" / "step-1"
    storage = torch.zeros(64 << 20)  # 256 MiB, saved whole behind the view
    record = deflated(storage[:32].view(8, 4))
    assert len(record) < 1 << 20
    file_name = plant(folder, "model.0.weight", record)
    model = make_model(seed=5)
    before = params(model)
    with pytest.raises(CheckpointError, match=rf"{file_name} holds a value.*unpacks \d+ bytes to "):
        load_checkpoint(folder, model=model)
    assert all(torch.equal(before[k], v) for k, v in params(model).items())


class _ZlibAsZstandard:
    """A stand-in for the ``zstandard`` module (not installed here): DCP's ZStandard extension
    calls ``ZstdDecompressor().stream_reader(stream)``; this one inflates zlib, which packs
    zeros as well as zstd does."""

    class ZstdDecompressor:
        def stream_reader(self, stream):
            import io
            import zlib

            return io.BytesIO(zlib.decompress(stream.read()))


def test_a_record_declaring_a_decompressing_transform_is_refused(tmp_path, monkeypatch):
    """DCP decompresses a record whose ``.metadata`` entry lists ``stream.zstd`` when zstandard
    or pyzstd is installed, and the stored-zip check was skipped for such a record: 0.3 MB on
    disk inflated to a 256 MiB storage behind a view of the weight's shape, and loaded (zeros).
    dscale.checkpoint writes no transforms, so one is refused. Oracle: the same record without
    the transform is refused by the stored-zip check; the model is unchanged either way."""
    import zlib

    from torch.distributed.checkpoint import _extension

    monkeypatch.setattr(_extension, "zstandard", _ZlibAsZstandard)
    CheckpointManager(tmp_path / "ckpt").save(1, model=make_model())
    folder = tmp_path / "ckpt" / "step-1"
    storage = torch.zeros(64 << 20)  # 256 MiB, saved whole behind the view
    buffer = io.BytesIO()
    torch.save(storage[:32].view(8, 4), buffer)  # a stored zip, as torch.save writes it
    record = zlib.compress(buffer.getvalue(), 9)
    assert len(record) < 1 << 20
    file_name = plant(folder, "model.0.weight", record)
    metadata = FileSystemReader(folder).read_metadata()
    (index,) = [i for i in metadata.storage_data if i.fqn == "model.0.weight"]
    metadata.storage_data[index].transform_descriptors = ["stream.zstd/1"]
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    reseal(folder)
    model = make_model(seed=5)
    before = params(model)
    with pytest.raises(CheckpointError, match=r"stream\.zstd.*dscale\.checkpoint writes none"):
        load_checkpoint(folder, model=model)
    assert all(torch.equal(before[k], v) for k, v in params(model).items())
    # Oracle: without the transform the same bytes are not a stored zip, and are refused.
    metadata.storage_data[index].transform_descriptors = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    reseal(folder)
    with pytest.raises(CheckpointError, match=rf"{file_name} holds a value"):
        load_checkpoint(folder, model=model)
    assert all(torch.equal(before[k], v) for k, v in params(model).items())


def test_a_record_whose_zip_entries_overlap_is_refused_before_torch_load(tmp_path, monkeypatch):
    """The overlapping-files zip bomb: a 1 MB stored record whose directory names 300 storages,
    all pointing at the same stored bytes. Each entry is stored and fits in the record, so the
    stored-zip check let it through and torch.load allocated 300 MB (a list, refused only
    after). Oracle: torch.load itself on the record, which returns 300 distinct storages."""
    import io as _io

    from dscale.checkpoint import _safe_io

    record = overlapping(1 << 18, 300)  # 1 MiB of floats, 300 names for it
    assert len(record) < 2 << 20
    direct = torch.load(_io.BytesIO(record), weights_only=True)
    assert len({t.untyped_storage().data_ptr() for t in direct}) == 300
    del direct
    loaded_bytes = []
    real_load = torch.load

    def spy(*args, **kwargs):
        obj = real_load(*args, **kwargs)
        tensors = obj if isinstance(obj, list) else [obj] if torch.is_tensor(obj) else []
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        loaded_bytes.append(sum(storages.values()))
        return obj

    monkeypatch.setattr(_safe_io.torch, "load", spy)
    CheckpointManager(tmp_path / "ckpt").save(1, model=make_model())
    folder = tmp_path / "ckpt" / "step-1"
    file_name = plant(folder, "model.0.weight", record)
    model = make_model(seed=5)
    before = params(model)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(folder, model=model)
    assert max(loaded_bytes, default=0) < 1 << 20, f"torch.load allocated {max(loaded_bytes)}"
    assert re.search(rf"{file_name} holds a value.*they overlap", str(refused.value))
    assert all(torch.equal(before[k], v) for k, v in params(model).items())


def test_a_scaler_file_inflating_past_its_bytes_is_refused_before_torch_load(tmp_path, monkeypatch):
    """load_scaler_file (a torch-saved scaler state dict) had no stored-zip check: a 0.3 MB
    file whose 'scale' is a view of a deflated 256 MiB storage made torch.load allocate it.
    Oracle: torch.load on the same file returns that storage; the scaler is unchanged."""
    import zipfile

    from dscale.checkpoint import _safe_io, load_scaler_file

    storage = torch.zeros(64 << 20)
    storage[0] = 1024.0
    state = {"scale": storage[:1], "growth_factor": 2.0, "backoff_factor": 0.5}
    state |= {"growth_interval": 2000, "_growth_tracker": 0}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    src = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    file = tmp_path / "scaler.pt"
    with zipfile.ZipFile(file, "w") as dst:
        for info in src.infolist():
            kind = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info), compress_type=kind)
    assert file.stat().st_size < 1 << 20
    loaded = torch.load(file, weights_only=True)["scale"]
    assert loaded.untyped_storage().nbytes() == 256 << 20
    del loaded
    calls = []
    real_load = torch.load
    monkeypatch.setattr(
        _safe_io.torch, "load", lambda *a, **k: calls.append(a) or real_load(*a, **k)
    )
    scaler = make_scaler(init_scale=8.0)
    before = scaler.state_dict()
    with pytest.raises(CheckpointError) as refused:
        load_scaler_file(scaler, file)
    assert calls == [], "torch.load read the file"
    assert re.search(r"scaler\.pt cannot be loaded.*unpacks", str(refused.value))
    assert scaler.state_dict() == before


def test_a_sparse_data_file_that_no_record_names_is_refused_before_it_is_hashed(
    tmp_path, monkeypatch
):
    """Holes were looked for only in data files that ``.metadata`` names: a 1 GiB sparse
    ``__7_0.distcp`` (4 kB on disk) listed in the manifest loaded, after every rank had hashed
    all of it (16 TiB on ext4 would take hours). Oracle: the same file written densely (a
    small one) is hashed and loads; the sparse one is refused before any data file is read."""
    from dscale.checkpoint import _hashing

    CheckpointManager(tmp_path / "ckpt").save(1, model=make_model())
    folder = tmp_path / "ckpt" / "step-1"
    extra = folder / "__7_0.distcp"
    extra.write_bytes(b"x" * 4096)  # dense: hashed, and loads
    reseal(folder)
    assert load_checkpoint(folder, model=make_model(seed=5)) == 1
    os.truncate(extra, 1 << 30)  # the rest a hole
    if os.stat(extra).st_blocks * 512 >= 1 << 30:
        pytest.skip("this filesystem does not make sparse files")
    reseal(folder)
    hashed = []
    real_verify = _hashing.verify_share
    monkeypatch.setattr(
        "dscale.checkpoint._load.verify_share",
        lambda path, entries, *a, **k: (
            hashed.extend(name for _, name in entries if name.startswith("__"))
            or real_verify(path, entries, *a, **k)
        ),
    )
    model = make_model(seed=5)
    before = params(model)
    with pytest.raises(CheckpointError, match=r"__7_0\.distcp is a sparse file.*no record"):
        load_checkpoint(folder, model=model)
    assert hashed == []
    assert all(torch.equal(before[k], v) for k, v in params(model).items())
