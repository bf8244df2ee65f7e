"""A mid-run state dict resumes exactly; without the fp32 masters it cannot."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from dscale import FP16Optimizer

from ._setup import flat, masters, mlp, train_step

SAVE_AT, END = 6, 14
POISON = {4, 10}  # one skipped step before the save, one after


def _build(seed: int = 0) -> tuple[torch.nn.Module, FP16Optimizer]:
    model = mlp(seed)
    opt = FP16Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 3},
    )
    return model, opt


def _run(model: torch.nn.Module, opt: FP16Optimizer, steps: range) -> None:
    for step in steps:
        train_step(model, opt, step, poison=step in POISON)


def _outcome(model: torch.nn.Module, opt: FP16Optimizer) -> dict[str, Any]:
    adam = [t for s in opt.state.values() for k, t in sorted(s.items()) if k != "step"]
    return {
        "model": flat(list(model.parameters())),
        "masters": masters(opt),
        "adam": flat(adam),
        "scaler": opt.state_dict()["scaler"],
    }


def _through_bytes(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_resume_from_a_mid_run_state_dict_continues_bit_identically() -> None:
    model, opt = _build()
    _run(model, opt, range(SAVE_AT))
    checkpoint = _through_bytes({"model": model.state_dict(), "optimizer": opt.state_dict()})
    _run(model, opt, range(SAVE_AT, END))
    expected = _outcome(model, opt)

    resumed_model, resumed = _build(seed=1)  # different init: everything must come from the file
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    _run(resumed_model, resumed, range(SAVE_AT, END))
    got = _outcome(resumed_model, resumed)

    assert torch.equal(got["model"], expected["model"])
    assert torch.equal(got["masters"], expected["masters"])
    assert torch.equal(got["adam"], expected["adam"])
    assert got["scaler"] == expected["scaler"]
    assert got["scaler"]["num_skipped_steps"] == len(POISON)


def test_masters_rebuilt_from_the_fp16_model_do_not_resume_exactly() -> None:
    """Negative control: the fp32 masters are the part of the state the fp16 model cannot give."""
    model, opt = _build()
    _run(model, opt, range(SAVE_AT))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    _run(model, opt, range(SAVE_AT, END))

    # Everything from the checkpoint except the masters, which come from the rounded fp16 weights.
    state = checkpoint["optimizer"]
    rounded = dict(checkpoint["model"])
    state["fp32_from_fp16"] = [[rounded[name].float() for name in rounded]]
    rebuilt_model, rebuilt = _build(seed=1)
    rebuilt_model.load_state_dict(checkpoint["model"])
    rebuilt.load_state_dict(state)
    _run(rebuilt_model, rebuilt, range(SAVE_AT, END))

    assert not torch.equal(masters(rebuilt), masters(opt))


def test_load_state_dict_sets_the_fp16_model_from_the_masters() -> None:
    model, opt = _build()
    _run(model, opt, range(3))
    state = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.load_state_dict(state)
    expected = flat([m.half() for g in state["fp32_from_fp16"] for m in g])
    assert torch.equal(flat(list(model.parameters())), expected)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sd: sd.pop("fp32_from_fp16"), "missing"),
        (lambda sd: sd.update(dynamic_loss_scale=False), "dynamic_loss_scale=False"),
        (lambda sd: sd["fp32_from_fp16"][0].pop(), "fp32 masters have shapes"),
        (lambda sd: sd.update(dscale_master_weights_version=99), "version"),
    ],
    ids=["no_masters", "static_vs_dynamic", "fewer_masters", "future_version"],
)
def test_a_rejected_state_dict_leaves_the_optimizer_unchanged(change: Any, message: str) -> None:
    model, opt = _build()
    _run(model, opt, range(3))
    before = _outcome(model, opt)
    other_model, other = _build(seed=1)
    _run(other_model, other, range(5))
    state = copy.deepcopy(other.state_dict())
    change(state)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    after = _outcome(model, opt)
    assert torch.equal(after["masters"], before["masters"])
    assert torch.equal(after["model"], before["model"])
    assert torch.equal(after["adam"], before["adam"])
    assert after["scaler"] == before["scaler"]
