"""FP8 inside the compiled region (docs/compiled-step.md, "FP8"): what traces and what does not.

A float8 model (torchao, emulated on the CPU) with a ``StepGuard(sync_free=True)`` compiles its
post-backward region fullgraph, equal to the eager run. ``Float8Numerics`` registers a step
callback (told ``applied`` on the host, and reading its agreed values with ``.tolist()``): in a
fullgraph region it raises the library's step-callback error; compiled without ``fullgraph``
(its calls graph breaks) its samples and the weights equal the eager run's. The oracle is the
same loop run eagerly. On main (2cac85f) the scaler's step was compiler-disabled, so the
fullgraph region raised "Skip inlining" for every configuration.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models

STEPS = 5


def _train(compile_as: dict[str, Any] | None, numerics_every: int | None) -> dict[str, Any]:
    torch._dynamo.reset()
    model = _models.net()
    fp8.convert_to_float8(model, emulate=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    guard = dscale.StepGuard("cpu", sync_free=True)
    numerics = fp8.Float8Numerics(model, guard, every=numerics_every) if numerics_every else None

    def region() -> None:
        guard.step(opt)
        guard.update()

    compiled = region if compile_as is None else torch.compile(region, **compile_as)
    samples = []
    for step in range(STEPS):
        tokens, target = _models.batch(step)
        guard.scale(_models.loss_of(model, tokens, target)).backward()
        if step == 3:
            model.blocks[0].fc1.weight.grad[0, 0] = float("inf")  # skipped
        (region if step == 0 else compiled)()  # one eager warm-up step
        opt.zero_grad(set_to_none=False)
        if numerics is not None and numerics.sampled_last_step:
            samples.append(numerics.snapshot())
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "skipped": guard.snapshot()["skipped_steps"],
        "samples": samples,
    }


def test_float8_model_with_a_sync_free_guard_compiles_fullgraph_equal_to_eager() -> None:
    eager = _train(None, None)
    ours = _train({"fullgraph": True, "backend": "aot_eager"}, None)
    assert eager["skipped"] == ours["skipped"] == 1
    for a, b in zip(ours["params"], eager["params"], strict=True):
        assert torch.equal(a, b)


def test_float8_numerics_raise_in_fullgraph_and_equal_eager_as_graph_breaks() -> None:
    with pytest.raises(Exception, match="step callback"):
        _train({"fullgraph": True, "backend": "eager"}, 2)
    eager = _train(None, 2)
    ours = _train({"backend": "eager"}, 2)
    assert len(eager["samples"]) >= 2  # sampled steps happened, with values to compare
    assert ours["samples"] == eager["samples"]
    assert ours["skipped"] == eager["skipped"] == 1
    for a, b in zip(ours["params"], eager["params"], strict=True):
        assert torch.equal(a, b)
