"""trainer.device: a GPU per rank or the CPU, never two NCCL ranks on one GPU."""

from __future__ import annotations

import pytest
import torch

from launch.worker import pick_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` GPUs (set_device recorded, not called)."""
    chosen: list[int] = []

    def have(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen

    return have


def test_auto_takes_each_rank_its_own_gpu_when_there_are_enough(gpus) -> None:
    chosen = gpus(2)
    assert pick_device("auto", 1, local_ranks=2) == torch.device("cuda", 1)
    assert chosen == [1]


def test_auto_with_more_ranks_than_gpus_runs_on_the_cpu_and_says_why(gpus, caplog) -> None:
    chosen = gpus(1)
    assert pick_device("auto", 0, local_ranks=2) == torch.device("cpu")
    assert chosen == []
    assert "nproc_per_node=1" in caplog.text


def test_cuda_with_more_ranks_than_gpus_is_refused_with_the_fix(gpus) -> None:
    gpus(1)
    with pytest.raises(RuntimeError, match=r"2 ranks on this node but 1 GPU.*nproc_per_node"):
        pick_device("cuda", 0, local_ranks=2)


def test_auto_without_cuda_is_the_cpu(gpus) -> None:
    gpus(0)
    assert pick_device("auto", 0, local_ranks=2) == torch.device("cpu")
