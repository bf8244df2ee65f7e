"""dscale.checkpoint keeps every entry of a scaler's state dict, and checks it as load_state_dict.

Oracle: the same scaler loaded with ``load_state_dict(saved.state_dict())``. Before, the
checkpoint dropped the string and None entries (spike_signals, hysteresis_refill, policy,
min_scale=None), so the loader kept its own, and a window saved by a gate watching "loss"
loaded into a gate watching "grad_norm", which load_state_dict refuses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dscale
from dscale.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from tests.checkpoint._helpers import make_model, params, train

GATE = {"spike_window": 8, "spike_warmup": 4}

# name: (saving scaler's arguments, loading scaler's arguments). The loader differs in every
# setting a state dict carries, so an entry the checkpoint loses shows as the loader's value.
CASES: dict[str, tuple[Any, Any]] = {
    "dynamic-refill-and-none": (
        lambda: dscale.GradScaler(
            "cpu",
            init_scale=1024.0,
            growth_interval=2,
            hysteresis=2,
            hysteresis_refill="on_clean_step",
        ),
        lambda: dscale.GradScaler(
            "cpu", init_scale=8.0, min_scale=1.0, max_scale=2.0**20, hysteresis=3
        ),
    ),
    "dynamic-bounds": (
        lambda: dscale.GradScaler("cpu", init_scale=1024.0, growth_interval=2, min_scale=2.0),
        lambda: dscale.GradScaler("cpu", init_scale=8.0, hysteresis_refill="on_clean_step"),
    ),
    "predictive": (
        lambda: dscale.GradScaler("cpu", policy="predictive", growth_interval=4),
        lambda: dscale.GradScaler("cpu", policy="predictive", growth_interval=4, init_scale=8.0),
    ),
    "gradscaler-spike-gate": (
        lambda: dscale.GradScaler("cpu", init_scale=1024.0, spike_signals=("loss",), **GATE),
        lambda: dscale.GradScaler("cpu", init_scale=8.0, spike_signals=("loss",), **GATE),
    ),
    "stepguard-spike-gate": (
        lambda: dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm"), **GATE),
        lambda: dscale.StepGuard("cpu", spike_signals=("loss", "grad_norm"), **GATE),
    ),
}


def _same(got: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Every key whose value differs (tensors: dtype, shape and values; else type and value)."""
    wrong = [f"{k}: missing" for k in expected if k not in got]
    wrong += [f"{k}: extra" for k in got if k not in expected]
    for key in sorted(set(got) & set(expected)):
        a, b = got[key], expected[key]
        if isinstance(b, torch.Tensor):
            same = isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        else:
            same = type(a) is type(b) and a == b
        if not same:
            wrong.append(f"{key}: {a!r} != {b!r}")
    return wrong


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_round_trip_keeps_every_entry_of_the_scaler_state_dict(tmp_path, case):
    make_saver, make_loader = CASES[case]
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = make_saver()
    train(model, opt, scaler, 6)  # an inf at step 2: trackers and counters move
    expected = scaler.state_dict()
    CheckpointManager(tmp_path).save(6, model=model, optimizer=opt, scaler=scaler)

    oracle = make_loader()
    oracle.load_state_dict(scaler.state_dict())
    assert _same(oracle.state_dict(), expected) == []  # load_state_dict keeps every entry

    loaded = make_loader()
    assert load_checkpoint(tmp_path / "step-6", scaler=loaded) == 6
    assert _same(loaded.state_dict(), expected) == []
    if case.startswith("dynamic"):
        assert _same(make_loader().state_dict(), expected)  # the loader's own entries differ


def _gate(signal: str) -> dscale.GradScaler:
    return dscale.GradScaler("cpu", init_scale=8.0, spike_signals=(signal,), **GATE)


def test_a_spike_window_of_another_signal_is_refused_as_load_state_dict_refuses_it(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saver = dscale.GradScaler("cpu", init_scale=1024.0, spike_signals=("loss",), **GATE)
    train(model, opt, saver, 6)
    CheckpointManager(tmp_path).save(6, model=model, optimizer=opt, scaler=saver)

    with pytest.raises(ValueError, match="spike_signals='loss' but this scaler watches") as direct:
        _gate("grad_norm").load_state_dict(saver.state_dict())

    fresh_model = make_model(seed=5)
    before, gate = params(fresh_model), _gate("grad_norm")
    untouched = gate.state_dict()
    with pytest.raises(CheckpointError) as through_checkpoint:
        load_checkpoint(tmp_path / "step-6", model=fresh_model, scaler=gate)
    assert str(direct.value) in str(through_checkpoint.value)
    assert _same(gate.state_dict(), untouched) == []  # nothing changed
    assert all(torch.equal(before[k], v) for k, v in params(fresh_model).items())

    # A StepGuard's dict into a GradScaler: refused by both ways in too.
    guard = dscale.StepGuard("cpu", spike_signals=("loss",), **GATE)
    CheckpointManager(tmp_path / "guard").save(1, model=model, scaler=guard)
    with pytest.raises(ValueError, match="saved by a StepGuard") as direct:
        _gate("loss").load_state_dict(guard.state_dict())
    with pytest.raises(CheckpointError) as through_checkpoint:
        load_checkpoint(tmp_path / "guard" / "step-1", scaler=_gate("loss"))
    assert str(direct.value) in str(through_checkpoint.value)


class _WithADict(dscale.GradScaler):
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "extra": {"a": 1}}


def test_a_scaler_entry_a_checkpoint_cannot_store_is_refused_at_save_naming_it(tmp_path):
    """Before, an entry of another type (here a dict) was dropped without a word."""
    with pytest.raises(TypeError, match=r"state_dict\(\)\['extra'\] is a dict"):
        CheckpointManager(tmp_path).save(1, model=make_model(), scaler=_WithADict("cpu"))
    assert list(tmp_path.iterdir()) == []
