"""Per-rank bodies of the multi-rank checkpoint tests (run by tests.multirank.run_ranks)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dscale.checkpoint import (
    CheckpointManager,
    CorruptCheckpointError,
    ScaleMismatchError,
    _publish,
    load_checkpoint,
)
from dscale.checkpoint._load import agree_on_scaler
from tests.checkpoint._helpers import make_model, make_scaler, optim_state, params, train


def _wrap(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def _pieces(strategy: str, seed: int = 0) -> tuple[torch.nn.Module, Any, Any]:
    model = _wrap(make_model(seed), strategy)
    # Fresh pieces (seed != 0) start from another scale, so a load that did nothing shows.
    scaler = make_scaler(init_scale=1024.0 if seed == 0 else 8.0)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), scaler


def _snapshot(step: int, model, opt, scaler) -> dict[str, Any]:
    return {
        "step": step,
        "params": params(model),
        "optim": optim_state(model, opt),
        "scaler": scaler.state_dict(),
    }


def save_then_check_failures(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    """Save step 3; fail to publish step 4; save a scale that differs per rank, load it back."""
    model, opt, scaler = _pieces(strategy)
    train(model, opt, scaler, 3, seed=1 + rank)
    torch.manual_seed(100 + rank)  # each rank's RNG differs and must come back as its own
    CheckpointManager(f"{root}/good").save(3, model=model, optimizer=opt, scaler=scaler)
    rng_draw = torch.rand(2)
    reference = _snapshot(3, model, opt, scaler)

    # Rank 0 fails between writing and publishing step 4 (disk full, say).
    def failing_publish(tmp: Any, final: Any) -> None:
        raise OSError(f"simulated failure before publishing {final}")

    real_publish, _publish.publish = _publish.publish, failing_publish
    publish_error = None
    try:
        CheckpointManager(f"{root}/good").save(4, model=model, optimizer=opt, scaler=scaler)
    except RuntimeError as exc:
        publish_error = str(exc)
    finally:
        _publish.publish = real_publish
    fresh_model, fresh_opt, fresh_scaler = _pieces(strategy, seed=5)
    resumed_step = CheckpointManager(f"{root}/good").resume(
        "auto", model=fresh_model, optimizer=fresh_opt, scaler=fresh_scaler
    )
    rng_restored = torch.equal(torch.rand(2), rng_draw)

    # Rank 1 holds another scale (as after a missed agreement); the save keeps both values.
    state = scaler.state_dict()
    state["scale"] = state["scale"] / 2 if rank == 1 else state["scale"]
    scaler.load_state_dict(state)
    live_error = None
    try:
        agree_on_scaler(scaler.state_dict(), None)
    except ScaleMismatchError as exc:
        live_error = str(exc)
    CheckpointManager(f"{root}/split").save(4, model=model, optimizer=opt, scaler=scaler)
    fresh_model, fresh_opt, fresh_scaler = _pieces(strategy, seed=7)
    before_refusals = params(fresh_model)
    saved_error = None
    try:
        load_checkpoint(
            f"{root}/split/step-4", model=fresh_model, optimizer=fresh_opt, scaler=fresh_scaler
        )
    except ScaleMismatchError as exc:
        saved_error = str(exc)
    # A corrupt shard (in a copy) that only one rank's share of the checksum work covers.
    if rank == 0:
        shutil.copytree(f"{root}/split/step-4", f"{root}/corrupt/step-4")
        shard = Path(f"{root}/corrupt/step-4/__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    corrupt_error = None
    try:
        load_checkpoint(
            f"{root}/corrupt/step-4", model=fresh_model, optimizer=fresh_opt, scaler=fresh_scaler
        )
    except CorruptCheckpointError as exc:
        corrupt_error = str(exc)
    after = params(fresh_model)
    unchanged = all(torch.equal(before_refusals[k], v) for k, v in after.items())
    return {
        "reference": reference,
        "live_error": live_error,
        "saved_error": saved_error,
        "corrupt_error": corrupt_error,
        "scale_after_failed_load": fresh_scaler.get_scale(),
        "unchanged_after_refusals": unchanged,
        "publish_error": publish_error,
        "resumed_step": resumed_step,
        "rng_restored": rng_restored,
        "rng_draw": rng_draw,
    }


def load_resharded(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    """Load ``root/good`` (written by 2 ranks) on this world size; return the full state."""
    model, opt, scaler = _pieces(strategy, seed=11)
    step = CheckpointManager(f"{root}/good").resume(
        "auto", model=model, optimizer=opt, scaler=scaler
    )
    return _snapshot(step, model, opt, scaler)


def fsdp1_async_then_ddp(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP1 with async_save=True (saved synchronously instead), reloaded into DDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(make_model(0), device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = make_scaler()
    train(model, opt, scaler, 3, seed=1 + rank)
    ckpt = CheckpointManager(root, async_save=True)
    ckpt.save(3, model=model, optimizer=opt, scaler=scaler)
    published_before_wait = ckpt.latest() is not None
    ckpt.wait()
    reference = _snapshot(3, model, opt, scaler)
    ddp, ddp_opt, ddp_scaler = _pieces("ddp", seed=4)
    step = CheckpointManager(root).resume("auto", model=ddp, optimizer=ddp_opt, scaler=ddp_scaler)
    return {
        "reference": reference,
        "loaded": _snapshot(step, ddp, ddp_opt, ddp_scaler),
        "published_before_wait": published_before_wait,
    }


def ddp_async_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """DDP with async_save=True: published by wait(), loads back."""
    model, opt, scaler = _pieces("ddp")
    train(model, opt, scaler, 2, seed=1 + rank)
    ckpt = CheckpointManager(root, async_save=True, every=2, keep=2)
    ckpt.maybe_save(2, model=model, optimizer=opt, scaler=scaler)
    reference = _snapshot(2, model, opt, scaler)
    train(model, opt, scaler, 2, seed=9)  # must not leak into step-2
    ckpt.maybe_save(4, model=model, optimizer=opt, scaler=scaler)  # waits for step 2 first
    ckpt.wait()
    fresh, fresh_opt, fresh_scaler = _pieces("ddp", seed=4)
    loaded = CheckpointManager(root).load(
        f"{root}/step-2", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler
    )
    return {
        "reference": reference,
        "loaded": _snapshot(loaded, fresh, fresh_opt, fresh_scaler),
        "published": sorted(p.name for p in Path(root).iterdir()),
    }


def async_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Both async scenarios in one spawn (spawning costs seconds)."""
    return {
        "ddp": ddp_async_save(rank, world, f"{root}/ddp"),
        "fsdp1": fsdp1_async_then_ddp(rank, world, f"{root}/fsdp1"),
    }


def one_choice_for_all_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    """resume("auto") when rank 1 sees another listing, and loads that one rank cannot read."""
    from dscale.checkpoint import CheckpointError, _hashing, _load, _manager

    # Which files this rank sums, while writing (streams) and by reading (file_digest).
    hashed: dict[str, list[str]] = {"written": [], "read": []}
    real_stream, real_file = _hashing._HashingStream.__init__, _hashing.file_digest

    def recording_stream(self, raw, errors):
        hashed["written"].append(Path(raw.name).name)
        real_stream(self, raw, errors)

    def recording_file(file, algorithm="crc32"):
        hashed["read"].append(Path(file).name)
        return real_file(file, algorithm)

    _hashing._HashingStream.__init__ = recording_stream
    _hashing.file_digest = recording_file
    model, opt, scaler = _pieces("plain")
    ckpt = CheckpointManager(root, keep=3)
    for step in (2, 4):
        train(model, opt, scaler, 1, seed=step)
        ckpt.save(step, model=model, optimizer=opt, scaler=scaler)
    out: dict[str, Any] = {"hashed_on_save": hashed}
    hashed = {"written": [], "read": []}

    # Rank 1's view of the folder lags (a network filesystem): it sees step-2 only.
    real_list = _manager.list_complete
    if rank == 1:
        _manager.list_complete = lambda root: [p for p in real_list(root) if p[0] == 2]
    fresh, fresh_opt, fresh_scaler = _pieces("plain", seed=5)
    out["auto_step"] = CheckpointManager(root).resume(
        "auto", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler
    )
    out["auto_params"] = params(fresh)
    _manager.list_complete = real_list
    out["hashed_on_load"] = hashed
    _hashing._HashingStream.__init__, _hashing.file_digest = real_stream, real_file

    # Rank 1 cannot read the metadata, then cannot read a data file.
    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path / ".metadata"))

    def unreadable_data(self, plan, planner):
        raise OSError(5, "Input/output error", str(self.path))

    real_read = _load.read_metadata
    from dscale.checkpoint._safe_io import SafeReader

    real_read_data = SafeReader.read_data
    for name in ("metadata", "data"):
        if rank == 1 and name == "metadata":
            _load.read_metadata = unreadable
        if rank == 1 and name == "data":
            SafeReader.read_data = unreadable_data
        fresh, fresh_opt, fresh_scaler = _pieces("plain", seed=6)
        before = params(fresh)
        try:
            CheckpointManager(root).resume(
                "auto", model=fresh, optimizer=fresh_opt, scaler=fresh_scaler
            )
            out[name] = None
        except CheckpointError as exc:
            out[name] = (type(exc).__name__, str(exc))
        out[f"{name}_unchanged"] = (
            all(torch.equal(before[k], v) for k, v in params(fresh).items())
            and fresh_scaler.get_scale() == 8.0
        )
        _load.read_metadata = real_read
        SafeReader.read_data = real_read_data
    return out
