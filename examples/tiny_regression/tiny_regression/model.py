"""The project's own model and data: an MLP that learns a fixed linear map from noisy samples."""

from __future__ import annotations

import torch
from torch import nn


class Regressor(nn.Module):
    """``layers`` hidden layers of width ``hidden``, then one output."""

    def __init__(self, features: int, hidden: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(x))
        return out


def batch(
    step: int, *, rank: int, seed: int, features: int, batch_size: int, noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of ``y = x @ w + noise``; a pure function of (seed, rank, step), so a resumed run
    sees the batches an unbroken run would have seen."""
    w = torch.linspace(-1.0, 1.0, features, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(batch_size, features, generator=g)
    y = x @ w + noise * torch.randn(batch_size, generator=g)
    return x, y.unsqueeze(1)
