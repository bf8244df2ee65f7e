"""Per-rank bodies of the multi-rank checkpoint tests (run by tests.multirank.run_ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dscale.checkpoint import CheckpointManager, ScaleMismatchError, _publish, load_checkpoint
from dscale.checkpoint._verify import verify_scaler_agreement
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
    return {"step": step, "params": params(model), "optim": optim_state(model, opt),
            "scaler": scaler.state_dict()}


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
        verify_scaler_agreement(scaler, None)
    except ScaleMismatchError as exc:
        live_error = str(exc)
    CheckpointManager(f"{root}/split").save(4, model=model, optimizer=opt, scaler=scaler)
    fresh_model, fresh_opt, fresh_scaler = _pieces(strategy, seed=7)
    saved_error = None
    try:
        load_checkpoint(f"{root}/split/step-4", model=fresh_model, optimizer=fresh_opt,
                        scaler=fresh_scaler)
    except ScaleMismatchError as exc:
        saved_error = str(exc)
    return {"reference": reference, "live_error": live_error, "saved_error": saved_error,
            "scale_after_failed_load": fresh_scaler.get_scale(), "publish_error": publish_error,
            "resumed_step": resumed_step, "rng_restored": rng_restored, "rng_draw": rng_draw}


def load_resharded(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    """Load ``root/good`` (written by 2 ranks) on this world size; return the full state."""
    model, opt, scaler = _pieces(strategy, seed=11)
    step = CheckpointManager(f"{root}/good").resume("auto", model=model, optimizer=opt,
                                                    scaler=scaler)
    return _snapshot(step, model, opt, scaler)
