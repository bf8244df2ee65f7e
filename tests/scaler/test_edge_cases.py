"""Edge cases a review found (each failed before its fix): counters, sync_free, fused unscale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dscale
from tests.scaler._setup import decide_on_device

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler.*:UserWarning")


def _iteration(scaler, model, opt, step: int, poison: bool) -> None:
    opt.zero_grad()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
    scaler.scale(model(x).sum()).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("on_device", [False, True])
def test_overflow_below_min_scale_is_not_a_growth(on_device: bool) -> None:
    """Scale below min_scale (update(new_scale=...)); an overflow clamps it UP to min_scale:
    neither a growth nor a back-off (the host rule), on the device path too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = dscale.GradScaler("cpu", init_scale=8.0, min_scale=1.0, growth_interval=100)
    if on_device:
        decide_on_device(scaler)
    _iteration(scaler, model, opt, 0, poison=False)
    scaler.update(new_scale=0.25)
    _iteration(scaler, model, opt, 1, poison=True)
    snap = scaler.snapshot()
    assert snap["scale"] == 1.0
    assert (snap["growths"], snap["backoffs"], snap["skipped_steps"]) == (0, 0, 1)
    counters = {k: v.item() for k, v in scaler.counters().items()}
    assert counters["growths"] == 0


def test_sync_free_skip_after_param_data_is_reassigned() -> None:
    """`p.data = ...` keeps id(p) but moves the storage: the flat snapshot is made again, so
    the skipped step is undone in the parameter's new storage."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = decide_on_device(dscale.GradScaler("cpu", init_scale=8.0, sync_free=True))
    _iteration(scaler, model, opt, 0, poison=False)
    _iteration(scaler, model, opt, 1, poison=False)
    for p in model.parameters():
        p.data = p.data.clone()  # e.g. re-materialising weights; same Parameter object
    before = [p.detach().clone() for p in model.parameters()]
    _iteration(scaler, model, opt, 2, poison=True)  # agreed overflow: must be a no-op
    assert not scaler.step_applied(opt)
    for b, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(b, p.detach())


@pytest.mark.parametrize("scale", [3.0, 1000.0])
def test_fused_host_path_matches_torch_bitwise_at_non_power_of_two_scale(scale: float) -> None:
    """The check pass unscales for a fused kernel only at a power-of-two scale, where multiplying
    by f32(1/scale) equals torch's division; at other scales the kernel divides, as torch's."""

    def run(scaler) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(16, 8)
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step))
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    kw = {"init_scale": scale, "growth_interval": 1000}
    expected = run(torch.amp.GradScaler("cpu", **kw))
    assert torch.equal(run(decide_on_device(dscale.GradScaler("cpu", **kw))), expected)
    assert torch.equal(run(dscale.GradScaler("cpu", **kw)), expected)


def test_sync_free_param_unfrozen_after_its_empty_state_entry_was_read() -> None:
    """optimizer.state is a defaultdict: reading optimizer.state[p] for a frozen p (a logger,
    a checkpoint helper) leaves an empty entry, so len(state) == len(params) and the flat path
    is taken; when p gets a grad later its state is created and masked_step raises
    "changed the set or shapes of its state tensors" instead of behaving like torch
    (skipped step: no state for p; applied step: state created).
    """

    def run(make):
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 2)
        opt = torch.optim.Adam([*a.parameters(), *b.parameters()], lr=0.01)
        scaler = make()
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            h = a(x)
            loss = h.sum() + (b(h).sum() if step >= 3 else 0)  # b frozen until step 3
            scaler.scale(loss).backward()
            if step == 3:
                a.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            if step == 1:
                _ = [len(opt.state[p]) for p in b.parameters()]  # inspection only
        return torch.cat([p.detach().reshape(-1) for p in [*a.parameters(), *b.parameters()]])

    expected = run(lambda: torch.amp.GradScaler("cpu", init_scale=8.0))
    got = run(lambda: decide_on_device(dscale.GradScaler("cpu", init_scale=8.0, sync_free=True)))
    assert torch.equal(got, expected)


def test_sync_free_skip_after_vector_to_parameters() -> None:
    """The same through torch's own API: nn.utils.vector_to_parameters sets p.data."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = decide_on_device(dscale.GradScaler("cpu", init_scale=8.0, sync_free=True))
    _iteration(scaler, model, opt, 0, poison=False)
    _iteration(scaler, model, opt, 1, poison=False)
    vec = nn.utils.parameters_to_vector(model.parameters())
    nn.utils.vector_to_parameters(vec.clone(), model.parameters())  # e.g. loading averaged weights
    before = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    _iteration(scaler, model, opt, 2, poison=True)
    assert not scaler.step_applied(opt)
    assert torch.equal(nn.utils.parameters_to_vector(model.parameters()).detach(), before)
