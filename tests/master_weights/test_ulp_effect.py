"""FP32 masters keep small updates that plain fp16 weights lose (../shared/seeds/002_*.txt).

The setup makes the stall certain, not likely: every weight lies in [1, 2), where fp16 values are
2**-10 apart (2**-11 just below 1.0), and every per-step update lr * grad is checked to be below
2**-12, a quarter of the smallest spacing. Each fp16 update therefore rounds back to the old weight.
"""

from __future__ import annotations

import torch

from dscale import FP16Optimizer

from ._setup import flat

STEPS = 300
LR = 5e-3
QUARTER_ULP_AT_1 = 2.0**-12  # below half the fp16 spacing anywhere in [1, 2)
FP16_ULP_IN_1_2 = 2.0**-10


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Start weights in [1.05, 1.9) (exact in fp16), inputs, and targets of a teacher 0.03 lower."""
    g = torch.Generator().manual_seed(0)
    w0 = (1.05 + 0.85 * torch.rand(4, 16, generator=g)).half().float()
    x = torch.randn(64, 16, generator=g).half().float()
    y = x @ (w0 - 0.03).T
    return w0, x, y


def _linear(w0: torch.Tensor, dtype: torch.dtype) -> torch.nn.Linear:
    model = torch.nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    return model.to(dtype)


def _loss(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x.to(model.weight.dtype)).float() - y).pow(2).mean()


def test_fp16_optimizer_tracks_fp32_where_plain_fp16_training_stalls() -> None:
    w0, x, y = _problem()

    reference = _linear(w0, torch.float32)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    plain = _linear(w0, torch.float16)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
    mastered = _linear(w0, torch.float16)
    opt = FP16Optimizer(torch.optim.SGD(mastered.parameters(), lr=LR), dynamic_loss_scale=True)

    for _ in range(STEPS):
        ref_opt.zero_grad()
        _loss(reference, x, y).backward()
        ref_opt.step()

        plain_opt.zero_grad()
        _loss(plain, x, y).backward()
        # The proof that plain fp16 cannot move: every update is under a quarter ULP.
        assert (LR * plain.weight.grad.float()).abs().max() < QUARTER_ULP_AT_1
        plain_opt.step()

        opt.zero_grad()
        opt.backward(_loss(mastered, x, y))
        opt.step()

    assert not opt.overflow
    moved = (reference.weight - w0).abs().max().item()
    assert moved > 10 * FP16_ULP_IN_1_2, "the fp32 reference must move many fp16 ULPs"
    # Plain fp16 lost every single update.
    assert torch.equal(plain.weight.float(), w0)
    # The masters follow fp32 closely; the fp16 model is the masters rounded (half an ULP more).
    master = opt.fp32_from_fp16_groups[0][0]
    assert (master - reference.weight).abs().max().item() < 0.05 * moved
    assert (mastered.weight.float() - reference.weight).abs().max().item() < FP16_ULP_IN_1_2
    assert torch.equal(mastered.weight, master.detach().half())

    with torch.no_grad():
        start, ref_end = _loss(_linear(w0, torch.float32), x, y), _loss(reference, x, y)
        plain_end, mastered_end = _loss(plain, x, y), _loss(mastered, x, y)
    assert ref_end < 0.5 * start
    assert plain_end == _loss(_linear(w0, torch.float16), x, y)
    assert abs(mastered_end - ref_end) < 0.05 * (start - ref_end)
    assert flat([mastered.weight]).isfinite().all()
