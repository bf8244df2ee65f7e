"""Small fp16 models, data and helpers shared by the master-weights tests (CPU only)."""

from __future__ import annotations

import torch

from dscale import master_weights as mw


def mlp(seed: int = 0) -> torch.nn.Module:
    """A 2-layer MLP in fp16 (CPU fp16 matmul works in torch 2.13)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    ).half()


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (x, y) batch for ``step`` (and ``rank``), x in fp16, y in fp32."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 8, generator=g).half()
    y = torch.randn(32, 4, generator=g)
    return x, y


def loss_of(model: torch.nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    """Mean squared error in fp32 on ``batch(step, rank)``."""
    x, y = batch(step, rank)
    return (model(x).float() - y).pow(2).mean()


def train_step(
    model: torch.nn.Module,
    opt: mw.FP16Optimizer,
    step: int,
    *,
    poison: bool = False,
    rank: int = 0,
) -> None:
    """One iteration; ``poison`` puts an inf into the first fp16 grad before the master copy."""
    opt.zero_grad()
    opt.backward(loss_of(model, step, rank), update_master_grads=False)
    if poison:
        first = next(model.parameters())
        first.grad.view(-1)[0] = float("inf")
    opt.update_master_grads()
    opt.step()


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All ``tensors`` as one fp32 vector, for bitwise comparison."""
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def masters(opt: mw.FP16Optimizer) -> torch.Tensor:
    """Every param the wrapped optimizer updates, flattened."""
    return flat([p for g in opt.param_groups for p in g["params"]])
