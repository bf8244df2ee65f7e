"""timm's NativeScaler with dscale's scaler swapped in: the documented one-liner, on 2 gloo ranks.

This is timm's own ``NativeScaler`` (timm 1.0.31, installed with ``--no-deps`` by the Makefile).
``import timm`` needs torchvision, whose registry build is CUDA's (and breaks ``import lightning``),
so the ranks import ``timm.utils.cuda`` (and the clipping it calls) without running
``timm/__init__.py`` or ``timm/utils/__init__.py``; nothing else of timm is involved.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import dscale
from tests.integrations._frameworks import (
    INF_STEP,
    INIT_SCALE,
    STEPS,
    TinyNet,
    batch,
    flat_params,
    poison_after_reduce,
)
from tests.multirank import run_ranks

TIMM = "1.0.31"  # the Makefile's TIMM_SPEC


def timm_native_scaler() -> type:
    """``timm.utils.cuda.NativeScaler`` from the installed timm, its package inits not run."""
    try:
        found = metadata.version("timm")
    except metadata.PackageNotFoundError:
        found = None
    if found != TIMM:
        raise RuntimeError(
            f"the timm tests need timm=={TIMM} (found {found}); `make install` puts it in "
            f"the venv with --no-deps (pip install --no-deps timm=={TIMM})"
        )
    spec = importlib.util.find_spec("timm")  # finds the package without importing it
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    for name, folder in (("timm", root), ("timm.utils", root / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package  # only inside the spawned ranks
    return importlib.import_module("timm.utils.cuda").NativeScaler


def _timm_loop(rank: int, world_size: int) -> dict[str, Any]:
    NativeScaler = timm_native_scaler()
    out: dict[str, Any] = {"module": NativeScaler.__module__}
    for kind in ("dscale", "torch"):
        loss_scaler = NativeScaler(device="cpu")
        if kind == "dscale":
            loss_scaler._scaler = dscale.GradScaler("cpu")  # the one-liner
        loss_scaler.load_state_dict({**loss_scaler.state_dict(), "scale": INIT_SCALE})
        model = DDP(TinyNet())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        current = {"step": -1}
        # NativeScaler unscales inside its __call__: the inf must come from inside backward.
        poison_after_reduce(model, lambda now=current: rank == 1 and now["step"] == INF_STEP)
        rows = []
        for step in range(STEPS):
            current["step"] = step
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(batch(rank, step)).float().square().mean()
            loss_scaler(loss, optimizer, clip_grad=10.0, parameters=model.parameters())
            rows.append({"scale": loss_scaler._scaler.get_scale(), "params": flat_params(model)})
        out[kind] = {"rows": rows, "state": loss_scaler.state_dict()}
    # timm's checkpoints save loss_scaler.state_dict() under "amp_scaler"; resume loads it back.
    resumed = NativeScaler(device="cpu")
    resumed._scaler = dscale.GradScaler("cpu")
    resumed.load_state_dict(out["dscale"]["state"])
    out["resumed"] = resumed.state_dict()
    return out


def test_timm_native_scaler_with_dscale_swapped_in_skips_on_every_rank() -> None:
    out = run_ranks(_timm_loop)
    dscale_rows = {rank: out[rank]["dscale"]["rows"] for rank in (0, 1)}
    for a, b in zip(dscale_rows[0], dscale_rows[1], strict=True):
        assert a == b  # same params and scale on both ranks at every step
    assert [r["scale"] for r in dscale_rows[0]] == [
        INIT_SCALE if s < INF_STEP else INIT_SCALE / 2 for s in range(STEPS)
    ]
    assert dscale_rows[0][INF_STEP]["params"] == dscale_rows[0][INF_STEP - 1]["params"]
    assert out[0]["module"] == "timm.utils.cuda"
    assert out[0]["dscale"]["state"]["num_skipped_steps"] == 1  # NativeScaler's state_dict
    assert out[0]["resumed"] == out[0]["dscale"]["state"]
    # torch's scaler in the same loop: rank 0 applied what rank 1 skipped.
    torch_rows = {rank: out[rank]["torch"]["rows"] for rank in (0, 1)}
    assert torch_rows[0][INF_STEP]["params"] != torch_rows[1][INF_STEP]["params"]
    assert torch_rows[0][-1]["scale"] == INIT_SCALE != torch_rows[1][-1]["scale"]
