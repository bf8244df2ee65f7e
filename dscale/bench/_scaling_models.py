"""The models and data of ``python -m dscale.bench scaling``.

``MLP``, ``GPT`` and ``batches`` are also the launcher's demo models and synthetic data:
``launch/models.py`` and ``launch/data.py`` import them from here, because the launcher depends on
the library and not the reverse, so the benchmark trains exactly what ``make run`` trains.

``WideRange`` is built to have a wide and shifting gradient range: residual branches scaled by
fixed gains of 1, 2**-10 and 2**-20 (fixed residual scaling, as SkipInit and DeepNet use; 2**-20
is about 1e-6), so the branches' weight gradients span about 20 binades for the whole run, and a
loss weight that sweeps over 2**-4 .. 2**4 during the run (a loss-weight schedule, as for an
auxiliary or KL term), so the whole gradient range shifts up and down by 8 binades.

The zoo (``ZOO``) holds the runs on which a scaling rule tuned on smooth models can lose:

* ``spiky``: the MLP with its first layer's weights scaled up 8x (wide activations), and every
  97th batch's loss 4x (a periodic spike: the grads of steps 97, 194, 291 are 4x);
* ``zero``: the GPT with a phase of 60 steps whose loss is multiplied by 0 (a fully masked batch,
  a loss weight scheduled at 0): every grad is 0 there;
* ``warmup``: the GPT under a linear LR warm-up to a high LR and a decay back, whose gradients
  shrink while it learns and grow when the LR is high;
* ``drift``: the MLP whose loss weight grows by 2**6 over the run (gradients that drift up).
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


class WideRange(nn.Module):
    """Per-token residual MLP whose branches carry fixed gains of 1, 2**-10 and 2**-20."""

    GAINS = (1.0, 2.0**-10, 2.0**-20)

    def __init__(self, vocab_size: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.branches = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
                for _ in self.GAINS
            ]
        )
        # Fixed (not learned) gains, as in SkipInit / DeepNet's fixed residual scaling: the
        # branches' gradients stay 10 and 20 binades below the others for the whole run.
        for i, g in enumerate(self.GAINS):
            self.register_buffer(f"gain{i}", torch.full((d_model,), g))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, branch in enumerate(self.branches):
            x = x + getattr(self, f"gain{i}") * branch(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


ZOO = ("spiky", "zero", "warmup", "drift")
SPIKE_EVERY = 97
ZERO_STEPS = range(40, 100)


def loss_weight(model: str, step: int, steps: int) -> float:
    """The loss weight of ``model`` at ``step`` (see the module docstring); 1 for most."""
    if model == "wide":
        return 2.0 ** (4.0 * math.sin(2.0 * math.pi * step / steps))
    if model == "spiky":
        return 4.0 if step > 0 and step % SPIKE_EVERY == 0 else 1.0
    if model == "zero":
        return 0.0 if step in ZERO_STEPS else 1.0
    if model == "drift":
        return 2.0 ** (6.0 * step / steps)
    return 1.0


def lr_factor(model: str, step: int, steps: int) -> float:
    """The LR multiplier at ``step``: ``warmup`` ramps to 10x over a third of the run, then back."""
    if model != "warmup":
        return 1.0
    third = max(steps // 3, 1)
    if step < third:
        return 10.0 * (step + 1) / third
    return 10.0 * max(1.0 - (step - third) / (steps - third), 0.05)


def build(model: str, seq_len: int) -> nn.Module:
    """The launcher's default ``gpt_small`` and ``mlp`` configs, the wide-range model, the zoo."""
    if model in ("gpt", "zero", "warmup"):
        return GPT(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=seq_len)
    if model in ("mlp", "drift"):
        return MLP(vocab_size=256, d_model=64, hidden=256, n_layers=2)
    if model == "spiky":
        mlp = MLP(vocab_size=256, d_model=64, hidden=256, n_layers=2)
        first = next(m for m in mlp.modules() if isinstance(m, nn.Linear))
        with torch.no_grad():
            first.weight.mul_(8.0)  # wide activations
        return mlp
    if model == "wide":
        return WideRange(vocab_size=256, d_model=64, hidden=256)
    raise ValueError(f"model must be one of gpt, mlp, wide, {', '.join(ZOO)}; got {model!r}")


def batches(
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
