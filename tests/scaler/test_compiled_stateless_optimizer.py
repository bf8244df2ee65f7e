"""A compiled sync_free step around an optimizer that keeps no state (SGD without momentum).

docs/compiled-step.md says a foreach or plain optimizer traces after an eager warm-up step that
creates its state; SGD without momentum never creates any, and the masked step under compile
refused it ("no optimizer state for every parameter yet") on every call, however many eager
steps ran first (r46b's finding). It masks the parameters alone now, and still refuses a step
that would create state. The oracle is the same loop eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dscale import GradScaler


def _run(compiled: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)  # no momentum: no state
    scaler = GradScaler("cpu", init_scale=2.0**8, sync_free=True)

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    fn = torch.compile(region, fullgraph=True, backend="eager") if compiled else region
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 model: "no float16 tensors"
        for i in range(3):
            scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
            if i == 1:
                model.weight.grad[0, 0] = float("inf")
            (fn if i else region)()
            opt.zero_grad(set_to_none=False)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_stateless_optimizer_steps_compiled_as_eager() -> None:
    assert torch.equal(_run(compiled=True), _run(compiled=False))


def test_a_compiled_step_that_would_create_state_is_refused_and_changes_nothing() -> None:
    """SGD with momentum creates its buffers at its first step: under fullgraph that step is
    refused (creating state on a step that may be skipped needs the flag on the host), and the
    parameters and the optimizer's buffers are left as they were."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    scaler = GradScaler("cpu", init_scale=2.0**8, sync_free=True)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 model: "no float16 tensors"
        scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
        with pytest.raises(Exception, match="no optimizer state") as raised:
            torch.compile(region, fullgraph=True, backend="eager")()
    assert "Run the first step(s) eagerly" in str(raised.value)
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), before)
    assert not any(opt.state[p] for p in model.parameters())
