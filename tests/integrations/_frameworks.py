"""Shared pieces for the framework tests: env for frameworks inside run_ranks, data, poisoning."""

from __future__ import annotations

import hashlib
import os

import torch
from torch import nn

INF_STEP = 2  # the iteration where rank 1 (only) gets an inf in its grads
STEPS = 5
INIT_SCALE = 2.0**8  # small enough that the tiny fp16 models never overflow on their own


def framework_env(rank: int, world_size: int) -> None:
    """The env a launcher would set, so frameworks see ranks that already exist (no spawn)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",  # never dialled: the gloo group already exists
    )


def batch(rank: int, step: int, rows: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, 8, generator=generator)


class TinyNet(nn.Module):
    """Two layers; remembers the dtype its hidden activation had (autocast on or off)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.hidden_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.fc1(x))
        self.hidden_dtype = hidden.dtype
        return self.fc2(hidden)


def poison(model: nn.Module) -> None:
    """An inf in this rank's first grad, after DDP's reduction (so only this rank sees it)."""
    grad = next(p for p in model.parameters() if p.grad is not None).grad
    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
    local.view(-1)[0] = float("inf")


def flat_params(model: nn.Module) -> str:
    """A digest of every parameter, gathered whole: equal digests mean bit-identical params.

    A digest, not the tensors: tests/multirank.py's result pipe deadlocks on results past the
    pipe buffer (64 KiB), and these runs return many rows.
    """
    parts = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        parts.append(t.float().reshape(-1).clone())
    return hashlib.sha256(torch.cat(parts).numpy().tobytes()).hexdigest()[:32]


def poison_after_reduce(ddp: nn.Module, when) -> None:
    """On ranks where ``when()`` is True, an inf lands in DDP's reduced grads (this rank only).

    For code paths that check the grads inside backward() (FP16Optimizer.backward), where
    poisoning after backward() would be too late.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        def after(fut):
            reduced = fut.value()
            if when():
                reduced.view(-1)[0] = float("inf")
            return reduced

        return allreduce_hook(None, bucket).then(after)

    ddp.register_comm_hook(None, hook)


def same_state(a: object, b: object) -> bool:
    """Exact equality of nested state dicts holding tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b
