"""Token batches: synthetic text-like bytes made on the fly, or windows of a plain text file.

A batch is a pure function of (seed, rank, step), so a resumed job sees exactly the batches it
would have seen without the restart, and no data-loader state needs checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dscale.models import token_batches

Batches = Callable[[int], torch.Tensor]


def _generator(seed: int, rank: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    return g


def synthetic_batches(
    seed: int, rank: int, seq_len: int, batch_size: int, noise: float, vocab_size: int
) -> Batches:
    """Sequences that follow ``next = (7 * prev + 3) % vocab`` except for ``noise`` of the bytes.

    The library's (``dscale.models``), so the scaling benchmark trains on the same data.
    """
    return token_batches(seed, seq_len, batch_size, noise, vocab_size, rank=rank)


def text_batches(seed: int, rank: int, seq_len: int, batch_size: int, path: str) -> Batches:
    """Random windows of ``seq_len + 1`` bytes from the file at ``path``."""
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
    if data.numel() <= seq_len + 1:
        raise ValueError(
            f"data.path={path!r} has {data.numel()} bytes, fewer than data.seq_len+2="
            f"{seq_len + 2}; use a longer file or a smaller data.seq_len"
        )

    def batch(step: int) -> torch.Tensor:
        g = _generator(seed, rank, step)
        starts = torch.randint(data.numel() - seq_len - 1, (batch_size,), generator=g)
        return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])

    return batch


def build_batches(data: dict[str, Any], *, seed: int, rank: int, vocab_size: int) -> Batches:
    """The batch function for ``data["name"]``; each rank gets its own stream."""
    common = {
        "seed": seed,
        "rank": rank,
        "seq_len": data["seq_len"],
        "batch_size": data["batch_size"],
    }
    if data["name"] == "synthetic":
        return synthetic_batches(**common, noise=data["noise"], vocab_size=vocab_size)
    if data["name"] == "text":
        return text_batches(**common, path=data["path"])
    raise ValueError(f"data={data['name']!r} is not a data source; choose synthetic or text")
