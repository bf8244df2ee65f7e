"""A small model and batches for the FP8 tests: dims divisible by 16, float8-convertible."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """embedding -> 2 blocks -> head (10 outputs: a dim torchao cannot take)."""

    def __init__(self, dim: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int = 0, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 64, (size, 16), generator=g)
    return tokens, (3 * tokens + 7) % 10


def loss_of(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return nn.functional.cross_entropy(out.float().flatten(0, 1), target.flatten())
