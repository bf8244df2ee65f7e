"""timm's NativeScaler with dscale's scaler swapped in: the documented one-liner, on 2 gloo ranks.

timm 1.0.31 cannot be imported here: every import path runs through timm.layers, which needs
torchvision, and the registry's torchvision is a CUDA build. So this runs a verbatim copy of
``timm.utils.cuda.NativeScaler`` (Apache-2.0, Ross Wightman), with ``dispatch_clip_grad``
reduced to its "norm" mode; the one-liner touches nothing else.
"""

from __future__ import annotations

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


def dispatch_clip_grad(parameters, value, mode="norm", norm_type=2.0):
    assert mode == "norm"
    torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)


class NativeScaler:  # timm/utils/cuda.py, timm 1.0.31, verbatim apart from formatting
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        try:
            self._scaler = torch.amp.GradScaler(device=device)
        except (AttributeError, TypeError):
            self._scaler = torch.cuda.amp.GradScaler()

    def __call__(
        self,
        loss,
        optimizer,
        clip_grad=None,
        clip_mode="norm",
        parameters=None,
        create_graph=False,
        need_update=True,
    ):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def _timm_loop(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
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
    assert out[0]["dscale"]["state"]["num_skipped_steps"] == 1  # NativeScaler's state_dict
    # torch's scaler in the same loop: rank 0 applied what rank 1 skipped.
    torch_rows = {rank: out[rank]["torch"]["rows"] for rank in (0, 1)}
    assert torch_rows[0][INF_STEP]["params"] != torch_rows[1][INF_STEP]["params"]
    assert torch_rows[0][-1]["scale"] == INIT_SCALE != torch_rows[1][-1]["scale"]
