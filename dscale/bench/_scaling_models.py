"""The models and data of ``python -m dscale.bench scaling``.

``MLP``, ``GPT`` and ``batches`` are the launcher's demo models and synthetic data, from their
public home ``dscale.models`` (the launcher imports them from there), so the benchmark trains
exactly what ``make run`` trains.

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

import torch
from torch import nn

from dscale.models import GPT, MLP
from dscale.models import token_batches as batches

__all__ = ["GPT", "MLP", "ZOO", "WideRange", "batches", "build", "loss_weight", "lr_factor"]


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
