"""Asynchronous saves on 2 gloo ranks: DDP saves in the background; FSDP1 falls back to sync."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint import _ranks
from tests.multirank import run_ranks


def _assert_same_state(got, want):
    assert got["step"] == want["step"]
    assert got["scaler"] == want["scaler"]
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0)
    torch.testing.assert_close(got["optim"], want["optim"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async"))
    return run_ranks(_ranks.async_saves, root, world_size=2, timeout_s=300, pg_timeout_s=120)


def test_async_save_ddp_publishes_a_snapshot_taken_at_save_time(results):
    for rank in (0, 1):
        ddp = results[rank]["ddp"]
        assert ddp["published"] == ["step-2", "step-4"]
        _assert_same_state(ddp["loaded"], ddp["reference"])


def test_async_save_fsdp1_falls_back_to_sync_and_loads_into_ddp(results):
    for rank in (0, 1):
        fsdp1 = results[rank]["fsdp1"]
        assert fsdp1["published_before_wait"]  # saved synchronously
        _assert_same_state(fsdp1["loaded"], fsdp1["reference"])
