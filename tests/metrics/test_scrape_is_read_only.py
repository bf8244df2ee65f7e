"""A scrape reads a host snapshot: it never writes, nor waits on, the training thread's tensors."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

import dscale
from dscale.metrics import ScalerCollector
from tests.scaler._setup import decide_on_device

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph")

LABELS = {"rank": "0", "local_rank": "0", "node": "n", "job_name": "unit"}


def _collector(scaler) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ScalerCollector(scaler, labels=LABELS))
    return registry


@pytest.mark.parametrize("sync_free", [False, True], ids=["plain", "sync_free"])
def test_a_scrape_between_scale_and_backward_changes_nothing(sync_free) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler("cpu", init_scale=8.0, growth_interval=1, sync_free=sync_free)
    if sync_free:
        decide_on_device(scaler)  # device-side state, as on a GPU
    registry = _collector(scaler)
    for step in range(4):
        opt.zero_grad()
        scaled = scaler.scale(model(torch.ones(2, 3)).sum())
        versions = [t._version for t in scaler._book.__dict__.values() if torch.is_tensor(t)]
        list(registry.collect())  # a scrape lands here, between scale() and backward()
        after = [t._version for t in scaler._book.__dict__.values() if torch.is_tensor(t)]
        assert versions == after, "the scrape wrote into the scaler's device tensors"
        scaled.backward()  # raises if the scrape changed the scale autograd saved
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    expected = scaler.snapshot()
    scrape = _collector(scaler)
    assert scrape.get_sample_value("dscale_loss_scale", LABELS) == expected["scale"]
    assert scrape.get_sample_value("dscale_optimizer_steps_total", LABELS) == 4
    assert scrape.get_sample_value("dscale_optimizer_steps_skipped_total", LABELS) == 1


def test_a_scrape_before_the_first_scale_leaves_the_scaler_unplaced() -> None:
    scaler = dscale.GradScaler("cpu", init_scale=4.0)
    registry = _collector(scaler)
    assert registry.get_sample_value("dscale_loss_scale", LABELS) == 4.0
    assert scaler._book.scale is None  # the first scale() still picks the device, as in torch
