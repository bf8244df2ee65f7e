"""The rank functions: one spawn per world size runs every setting and scaler of that size."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel import _meshes

#: world size -> the settings run on it
SETTINGS = {2: ("tp", "tp_sp"), 4: ("fsdp_tp", "hsdp")}


def _scalers() -> dict[str, Any]:
    import dscale

    return {
        "torch": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
        "dscale": lambda: dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
        "dscale_sync_free": lambda: dscale.GradScaler(
            "cpu", init_scale=2.0**10, growth_interval=1, sync_free=True
        ),
        "dscale_predictive": lambda: dscale.GradScaler(
            "cpu", init_scale=2.0**10, growth_interval=1, policy="predictive"
        ),
        "step_guard_gate": lambda: dscale.StepGuard(
            "cpu", spike_signals=("loss", "grad_norm"), spike_window=2, spike_warmup=2
        ),
    }


def run_settings(rank: int, world_size: int) -> dict[str, Any]:
    """Every setting of this world size under every scaler, the oracle beside each."""
    out: dict[str, Any] = {}
    for name in SETTINGS[world_size]:
        for first in (True, False) if name == "tp" else (False,):
            key = f"{name}_replicated_first" if first else name
            out[key] = {"oracle": _meshes.run_oracle(_meshes.build(name, rank, world_size), first)}
            for label, make in _scalers().items():
                setting = _meshes.build(name, rank, world_size)
                out[key][label] = _meshes.run(setting, rank, make, first=first)
            built = _meshes.build(name, rank, world_size)
            out[key]["replicas"] = (built.replicas, built.replica_key)
    return out
