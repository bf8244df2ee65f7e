"""The two models the job can train: a tiny per-token MLP and a small GPT-style transformer.

Both map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``; the transformer's blocks are
the units that FSDP2 shards (``blocks()``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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


def build_model(model: dict[str, Any], seq_len: int) -> nn.Module:
    """Build the model named by ``model["name"]`` from its config fields."""
    fields = {k: v for k, v in model.items() if k != "name"}
    if model["name"] == "mlp":
        return MLP(**fields)
    if model["name"] == "gpt_small":
        return GPT(**fields, seq_len=seq_len)
    raise ValueError(f"model={model['name']!r} is not a model; choose model=mlp or model=gpt_small")
