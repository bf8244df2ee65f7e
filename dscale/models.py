"""Small models and synthetic token data: the launcher's demo job and the scaling benchmark.

``MLP`` and ``GPT`` map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``; their
``blocks()`` are the units FSDP2 shards. ``token_batches`` makes text-like token sequences on the
fly. They live here, public, because two consumers need the very same code: ``python -m launch``
trains them (``launch/models.py``, ``launch/data.py``) and ``python -m dscale.bench scaling``
measures the scaling policies on them, so the benchmark trains exactly what ``make run`` trains.
Not part of the scaler's API (``dscale.__all__``): examples and test subjects.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["GPT", "MLP", "Block", "token_batches"]


class MLP(nn.Module):
    """Embedding, ``n_layers`` hidden layers, logits: a bigram model with a little depth."""

    def __init__(self, vocab_size: int, d_model: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        layers: list[nn.Module] = []
        width = d_model
        for _ in range(n_layers):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.layers = nn.ModuleList([nn.Sequential(*layers)])
        self.head = nn.Linear(width, vocab_size)

    def blocks(self) -> list[nn.Module]:
        """The units FSDP2 shards."""
        return list(self.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits: torch.Tensor = self.head(x)
        return logits


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, final norm, logits."""

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, seq_len: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.layers = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def blocks(self) -> list[nn.Module]:
        """The units FSDP2 shards."""
        return list(self.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embed(tokens) + self.pos(positions)
        for layer in self.layers:
            x = layer(x, mask)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def token_batches(
    seed: int,
    seq_len: int,
    batch_size: int,
    noise: float = 0.1,
    vocab_size: int = 256,
    *,
    rank: int = 0,
) -> Callable[[int], torch.Tensor]:
    """Sequences that follow ``next = (7 * prev + 3) % vocab`` except for ``noise`` of the bytes.

    A batch is a pure function of (seed, rank, step), so a resumed run sees the same batches.
    """

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(seed * 1_000_003 + rank * 10_007 + step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (batch_size,), generator=g)
        random = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=g)
        flip = torch.rand(batch_size, seq_len + 1, generator=g) < noise
        for t in range(1, seq_len + 1):
            rule = (7 * tokens[:, t - 1] + 3) % vocab_size
            tokens[:, t] = torch.where(flip[:, t], random[:, t], rule)
        return tokens

    return batch
