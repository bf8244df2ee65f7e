"""Issue 22 (3): torch.compile around the scaler on 2 gloo ranks, with torch's scaler as oracle.

Rank 1 alone puts an inf in a grad at iteration 1. torch's scaler skips on rank 1 only; dscale must
skip on both ranks, and each rank's result must equal torch's on rank 1 (the rank whose own
decisions are the agreed ones) bit for bit. On de59675 (main before this change) a compiled function
holding scale/backward/step/update crashed with UnsafeScriptObjectError (attr=_device_types) from
dscale/_dist.py.
"""

from __future__ import annotations

from typing import Any

import torch

import dscale
from tests.multirank import run_ranks

# what is compiled, and how
SCENARIOS = [
    ("model", "default"),
    ("optimizer_step", "default"),
    ("train_function", "default"),
    ("train_function", "max-autotune-no-cudagraphs"),
]


def _run(rank: int, which: str, mode: str, make_scaler: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model: Any = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = make_scaler()
    if which == "model":
        model = torch.compile(model, mode=mode)
    if which == "optimizer_step":
        opt.step = torch.compile(opt.step, mode=mode)  # type: ignore[method-assign]

    def train(x: torch.Tensor, poison: bool) -> None:
        scaler.scale(model(x).sum()).backward()
        if poison:
            next(iter(model.parameters())).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    if which == "train_function":
        train = torch.compile(train, mode=mode)
    scales = []
    for i in range(3):
        train(torch.full((2, 4), float(i + 1)), rank == 1 and i == 1)
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {"scales": scales, "params": [p.detach().clone() for p in model.parameters()]}


def _compiled_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for which, mode in SCENARIOS:
        out[f"{which}-{mode}"] = {
            "torch": _run(rank, which, mode, lambda: torch.amp.GradScaler("cpu", init_scale=16.0)),
            "dscale": _run(rank, which, mode, lambda: dscale.GradScaler("cpu", init_scale=16.0)),
        }
    return out


def test_compiled_training_skips_on_every_rank_like_torch_on_the_overflowing_rank() -> None:
    out = run_ranks(_compiled_scenarios, timeout_s=400.0)
    for which, mode in SCENARIOS:
        key = f"{which}-{mode}"
        oracle = out[1][key]["torch"]
        assert oracle["scales"] == [16.0, 8.0, 8.0], key
        # negative control: torch's scaler on rank 0 never saw the inf and did not skip
        assert out[0][key]["torch"]["scales"] == [16.0, 16.0, 16.0], key
        for rank in (0, 1):
            ours = out[rank][key]["dscale"]
            assert ours["scales"] == oracle["scales"], (key, rank)
            for a, b, c in zip(ours["params"], oracle["params"], out[0][key]["dscale"]["params"]):
                assert torch.equal(a, c), (key, rank)  # the ranks agree bit for bit
                if which == "train_function":
                    # torch's scaler lets dynamo trace opt.step() into an inductor kernel, while
                    # dscale's step() runs it eagerly: the same maths, not the same rounding.
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
                else:
                    assert torch.equal(a, b), (key, rank)
