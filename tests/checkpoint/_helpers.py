"""Shared pieces for checkpoint tests: a tiny model, a scaler, and a few training steps."""

from __future__ import annotations

from typing import Any

import torch


def make_scaler(init_scale: float = 1024.0, growth_interval: int = 2) -> Any:
    """dscale.GradScaler when it exists, else torch's CPU scaler (same API and keys)."""
    try:
        from dscale import GradScaler  # type: ignore[attr-defined]
    except ImportError:
        return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)


def make_model(seed: int = 0, hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(hidden, 4),
    )


def train(model: torch.nn.Module, opt: Any, scaler: Any, steps: int, seed: int = 1) -> None:
    """A few scaled steps; an inf at the third step makes the scaler back off."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(6, 4, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if i == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters by name, without wrapper prefixes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def optim_state(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """Full optimizer state keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()}


def reseal(folder) -> None:
    """Rewrite the checksum manifest for the folder's current files, as an attacker could."""
    from dscale.checkpoint._hashing import file_digest
    from dscale.checkpoint._layout import MANIFESTS, find_manifest

    manifest = find_manifest(folder)
    lines = [
        f"{file_digest(f, MANIFESTS[manifest.name])}  {f.name}\n"
        for f in sorted(folder.iterdir())
        if f.is_file() and f.name not in MANIFESTS
    ]
    manifest.write_text("".join(lines))
