"""The two models the job can train: a tiny per-token MLP and a small GPT-style transformer.

Both map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``; their ``blocks()`` are the
units that FSDP2 shards. They live in the library (``dscale.models``), so that
``python -m dscale.bench scaling`` trains exactly these models; the launcher only builds them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dscale.models import GPT, MLP

__all__ = ["GPT", "MLP", "build_model"]


def build_model(model: dict[str, Any], seq_len: int) -> nn.Module:
    """Build the model named by ``model["name"]`` from its config fields."""
    fields = {k: v for k, v in model.items() if k != "name"}
    if model["name"] == "mlp":
        return MLP(**fields)
    if model["name"] == "gpt_small":
        return GPT(**fields, seq_len=seq_len)
    raise ValueError(f"model={model['name']!r} is not a model; choose model=mlp or model=gpt_small")
