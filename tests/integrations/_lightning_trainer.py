"""Trainer runs for test_lightning.py, inside the ranks lightning_checks() already runs on.

One batch per rank per epoch, so epoch e is optimizer step e and a resume at an epoch boundary
sees the same data as the uninterrupted run.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning as L
import torch

from tests.integrations._frameworks import (
    INF_STEP,
    INIT_SCALE,
    STEPS,
    TinyNet,
    batch,
    flat_params,
    poison,
    poison_after_reduce,
)


class LitNet(L.LightningModule):
    def __init__(self, fused: bool = True, poison_inside_reduce: bool = False) -> None:
        super().__init__()
        self.net = TinyNet()
        self.fused = fused
        self.poison_inside_reduce = poison_inside_reduce
        self.rows: list[dict[str, Any]] = []
        self.loaded_scaler: dict[str, Any] | None = None

    def training_step(self, data: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = data[0].to(torch.float16) if self.poison_inside_reduce else data[0]
        return self.net(x).float().square().mean()

    def on_train_start(self) -> None:
        precision = self.trainer.precision_plugin
        self.loaded_scaler = copy.deepcopy(precision.state_dict())  # masters: live tensors
        if self.poison_inside_reduce:  # FP16Optimizer checks the grads inside backward()
            poison_after_reduce(self.trainer.strategy.model, self._poison_now)

    def _poison_now(self) -> bool:
        return self.global_rank == 1 and self.current_epoch == INF_STEP

    def on_after_backward(self) -> None:
        if not self.poison_inside_reduce and self._poison_now():
            poison(self.net)  # DDP has reduced: only this rank's grads hold the inf

    def on_train_epoch_end(self) -> None:
        scheduler = self.lr_schedulers()
        precision = self.trainer.precision_plugin
        scaler = getattr(precision, "scaler", None)
        if scaler is not None:
            scale = scaler.get_scale()
        else:
            scale = precision.fp16_optimizer(self.optimizers().optimizer).loss_scale
        self.rows.append({"scale": scale, "sched": scheduler.last_epoch, **self._params()})

    def _params(self) -> dict[str, Any]:
        finite = all(bool(p.detach().isfinite().all()) for p in self.net.parameters())
        return {"params": flat_params(self.net), "finite": finite}

    def configure_optimizers(self) -> Any:
        if self.fused:
            opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ShardedLitNet(LitNet):
    """LitNet with FSDP2 applied by the Trainer's ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net.fc1, mesh=mesh)
        fully_shard(self.net.fc2, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class FSDP1LitNet(LitNet):
    """LitNet wrapped in torch's FSDP1 by configure_model; Lightning's FSDPStrategy keeps that.

    Lightning would wrap with ``device_id=None`` on the CPU, which FSDP1 refuses.
    """

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not isinstance(self.net, FullyShardedDataParallel):
            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"))

    def _params(self) -> dict[str, Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(self.net):
            return super()._params()


def _cpu_fsdp_strategy() -> Any:
    """Lightning's FSDPStrategy on the CPU: its code unchanged, its accelerator check passed.

    Lightning refuses ``type(strategy) is FSDPStrategy`` without a CUDA accelerator
    (``accelerator_connector.py``); a subclass that changes nothing is not refused.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):  # type: ignore[misc]
        pass

    return CPUFSDPStrategy(state_dict_type="sharded")


def _loader(rank: int) -> Any:
    # 8 samples, batch 4, DistributedSampler over 2 ranks: one batch per rank per epoch.
    data = torch.cat([batch(r, 0) for r in range(2)])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def _fit(
    rank: int,
    plugin: Any,
    epochs: int,
    module: LitNet,
    clip: float | None,
    ckpt_path: str | None = None,
) -> LitNet:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy: Any = "ddp"
    if isinstance(module, ShardedLitNet):
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif isinstance(module, FSDP1LitNet):
        strategy = _cpu_fsdp_strategy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[plugin],
        max_epochs=epochs,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, _loader(rank), ckpt_path=ckpt_path)
    module.trainer_ref = trainer  # type: ignore[attr-defined]
    return module


def trainer_checks(rank: int, tmp: str) -> dict[str, Any]:
    from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixed

    import dscale
    from dscale.integrations import lightning as dscale_lightning

    def dscale_plugin() -> Any:
        return dscale_lightning.MixedPrecision(dscale.GradScaler("cpu", init_scale=INIT_SCALE))

    out: dict[str, Any] = {}
    # clip=10 with a fused AdamW: Lightning's own plugin refuses that combination.
    full = _fit(rank, dscale_plugin(), STEPS, LitNet(), clip=10.0)
    out["trainer-dscale"] = full.rows
    torch_plugin = LightningMixed(
        "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    )
    out["trainer-torch"] = _fit(rank, torch_plugin, STEPS, LitNet(), clip=None).rows

    # Stop after the skipped step, save, resume in a new Trainer: equal to the full run.
    first = _fit(rank, dscale_plugin(), INF_STEP + 1, LitNet(), clip=10.0)
    path = f"{tmp}/trainer.ckpt"
    first.trainer_ref.save_checkpoint(path)  # type: ignore[attr-defined]
    checkpoint = torch.load(path, weights_only=False)
    resumed = _fit(rank, dscale_plugin(), STEPS, LitNet(), clip=10.0, ckpt_path=path)
    out["trainer-ddp-resume"] = {
        "in_checkpoint": checkpoint.get("MixedPrecision"),
        "loaded": resumed.loaded_scaler,
        "rows": resumed.rows,
    }

    # The same under the Trainer's ModelParallelStrategy (FSDP2; a sharded DCP checkpoint).
    out["trainer-fsdp2"] = _fit(rank, dscale_plugin(), STEPS, ShardedLitNet(), clip=10.0).rows
    first = _fit(rank, dscale_plugin(), INF_STEP + 1, ShardedLitNet(), clip=10.0)
    path = f"{tmp}/trainer-fsdp2.ckpt"
    first.trainer_ref.save_checkpoint(path)  # type: ignore[attr-defined]
    resumed = _fit(rank, dscale_plugin(), STEPS, ShardedLitNet(), clip=10.0, ckpt_path=path)
    out["trainer-fsdp2-resume"] = {
        "in_checkpoint": first.trainer_ref.precision_plugin.state_dict(),  # type: ignore[attr-defined]
        "loaded": resumed.loaded_scaler,
        "rows": resumed.rows,
    }

    # Lightning's FSDP strategy (FSDP1) with dscale's FSDPPrecision; a sharded checkpoint.
    # No gradient_clip_val: Lightning's FSDPPrecision, and so dscale's, refuses norm clipping.
    def fsdp_plugin() -> Any:
        return dscale_lightning.FSDPPrecision(dscale.GradScaler("cpu", init_scale=INIT_SCALE))

    out["trainer-fsdp1"] = _fit(rank, fsdp_plugin(), STEPS, FSDP1LitNet(), clip=None).rows
    first = _fit(rank, fsdp_plugin(), INF_STEP + 1, FSDP1LitNet(), clip=None)
    path = f"{tmp}/trainer-fsdp1.ckpt"  # a folder: sharded state, the rest in meta.pt
    first.trainer_ref.save_checkpoint(path)  # type: ignore[attr-defined]
    checkpoint = torch.load(f"{path}/meta.pt", weights_only=False)
    resumed = _fit(rank, fsdp_plugin(), STEPS, FSDP1LitNet(), clip=None, ckpt_path=path)
    out["trainer-fsdp1-resume"] = {
        "in_checkpoint": checkpoint.get("FSDPPrecision"),
        "loaded": resumed.loaded_scaler,
        "rows": resumed.rows,
    }
    # Lightning's own FSDPPrecision takes no scaler (and on the CPU no autocast either).
    from lightning.pytorch.plugins.precision import FSDPPrecision as LightningFSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling"
        lightning_fsdp = LightningFSDP("16-mixed")
    out["trainer-fsdp1-lightning"] = {
        "scaler": type(lightning_fsdp.scaler).__name__,
        "scaler_enabled": lightning_fsdp.scaler.is_enabled(),
        "rows": _fit(rank, lightning_fsdp, STEPS, FSDP1LitNet(), clip=None).rows,
    }

    def masters() -> Any:
        return dscale_lightning.MasterWeightsPrecision({"init_scale": INIT_SCALE})

    def masters_net() -> LitNet:
        return LitNet(fused=False, poison_inside_reduce=True)

    module = _fit(rank, masters(), STEPS, masters_net(), clip=None)
    out["trainer-masters"] = {
        "rows": module.rows,
        "dtype": next(module.net.parameters()).dtype,
    }
    first = _fit(rank, masters(), INF_STEP + 1, masters_net(), clip=None)
    path = f"{tmp}/trainer-masters.ckpt"
    first.trainer_ref.save_checkpoint(path)  # type: ignore[attr-defined]
    checkpoint = torch.load(path, weights_only=False)
    resumed = _fit(rank, masters(), STEPS, masters_net(), clip=None, ckpt_path=path)
    out["trainer-masters-resume"] = {
        "in_checkpoint": checkpoint.get("MasterWeightsPrecision"),
        "loaded": resumed.loaded_scaler,  # the plugin's state as training restarts
        "rows": resumed.rows,
    }
    return out
