"""Issue 46 review (r46a): attach() under torch.compile.

attach() folds the check into DDP's reduction; step() then reads what the hooks recorded on the
host (which grads they left, by identity and version), which does not trace. Under
``fullgraph=True`` the compiled region must raise one error that names attach() and the
configuration that compiles; without fullgraph it must run (eagerly) and equal the eager run bit
for bit, infs in the input included. Before (2a7fd9e), fullgraph raised dynamo's "Dynamo does not
know how to trace method `__call__` of class `attrgetter`" from inside the hooks, naming neither
attach() nor what to do.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch._dynamo

import dscale
from tests.multirank import run_ranks

STEPS = 8


def _train(compile_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    scaler = dscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, sync_free=True)
    scaler.attach(ddp)

    def region() -> None:
        scaler.step(opt)
        scaler.update()

    call = region
    if compile_kwargs is not None:
        call = torch.compile(region, backend="aot_eager", **compile_kwargs)
    scales = []
    for i in range(STEPS):
        x = torch.linspace(-1.0, 1.0, 24).reshape(4, 6) * (1 + i % 3)
        if i == 4:
            x[0, 0] = math.inf  # an inf in the grads: skipped, backed off
        scaler.scale(ddp(x).square().mean()).backward()
        (region if i < 2 else call)()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {"scales": scales, "params": [p.detach().clone() for p in model.parameters()]}


def _attached(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _train(None)
        broken = _train({})
        try:
            _train({"fullgraph": True})
            error = ""
        except torch._dynamo.exc.Unsupported as exc:
            error = str(exc)
    return {"eager": eager, "broken": broken, "error": error}


def test_attach_under_compile_names_itself_under_fullgraph_and_equals_eager_without() -> None:
    """fullgraph: attach()'s reason and what compiles; without: eager's results bit for bit."""
    out = run_ranks(_attached, world_size=1)[0]
    assert "attach()" in out["error"] and "sync_free=True" in out["error"], out["error"][:400]
    eager, broken = out["eager"], out["broken"]
    assert broken["scales"] == eager["scales"]
    assert eager["scales"][4] < eager["scales"][3]  # the inf was caught: the scenario can fail
    for a, b in zip(broken["params"], eager["params"], strict=True):
        assert torch.equal(a, b)
