"""The spike gate in a handful of ops decides and saves exactly as the gate it replaced.

Oracle: ``data/spike_runs.json``, recorded by ``data/record_spike_runs.py``: six long random runs
at e6f0fe2 (the gate before the rewrites: a ring with masked statistics in ~74 one-element ops;
StepGuard and GradScaler, the host decision, the device decision of a fused optimizer and
``sync_free``; windows of 12 to 128 that wrap many times; loss and grad-norm spikes, overflows,
losses that are not finite, and a run stuck on a new level), and two runs watching one signal
(the loss alone, fused; the grad norm alone, ``sync_free`` GradScaler) at 0010076 (the gate in
27-28 ops, before the matrices in turn). Replayed here, every step's decision, the snapshots and
the state dicts (window values as float hex) must be the recorded ones.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import dscale
from dscale.bench._ops import force_device_decision

DATA = Path(__file__).parent / "data"


def _recorder():
    spec = importlib.util.spec_from_file_location("record", DATA / "record_spike_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECORDER = _recorder()
RECORDED = json.loads((DATA / "spike_runs.json").read_text())


@pytest.mark.filterwarnings("ignore:the spike gate skipped")
@pytest.mark.parametrize("run", RECORDER.RUNS, ids=[r[0] for r in RECORDER.RUNS])
def test_every_decision_snapshot_and_state_equals_the_recorded_gate(run) -> None:
    replayed = RECORDER.run(*run)
    recorded = RECORDED[run[0]]
    first = next(
        (i for i, (a, b) in enumerate(zip(replayed["decisions"], recorded["decisions"])) if a != b),
        None,
    )
    assert first is None, f"step {first} decided differently"
    assert replayed["decisions"] == recorded["decisions"]
    assert replayed["snapshots"] == recorded["snapshots"]
    assert replayed["states"] == recorded["states"]


def test_an_old_state_dict_with_a_stale_slot_loads_as_the_old_gate_read_it() -> None:
    # The old gate masked the slots past the values entered; a dict whose slot 3 holds a value
    # that never entered (entered=3) must decide as if the slot were empty, and save it as 0.
    guard = dscale.StepGuard("cpu", spike_signals=("loss",), spike_window=8, spike_warmup=3)
    state = guard.state_dict()
    state["spike_window_values"] = torch.tensor(
        [[1.0, 1.1, 0.9, 50.0, 0, 0, 0, 0]], dtype=torch.float64
    )
    state["spike_window_entered"] = 3
    guard.load_state_dict(state)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    force_device_decision(guard)
    for loss, applied in ((1.05, True), (5.0, False)):  # 5.0 is far above 1.0 +- 0.1
        guard.scale(torch.tensor(loss))
        param.grad = torch.ones(2)
        before = param.detach().clone()
        guard.step(opt)
        guard.update()
        assert (not torch.equal(before, param)) is applied, loss
    saved = guard.state_dict()["spike_window_values"]
    entered = torch.tensor(1.05).item()  # the loss as fp32, as the gate keeps it
    assert saved.tolist() == [[1.0, 1.1, 0.9, entered, 0, 0, 0, 0]]


@pytest.mark.filterwarnings("ignore:the spike gate skipped")
def test_the_host_and_device_decisions_of_the_gate_are_bit_identical() -> None:
    # The same run (fused SGD) decided on the host (the CPU's free read of the agreed vector)
    # and on the device (as on CUDA): every decision, snapshot and state dict alike.
    common = {"kind": "guard", "sync_free": False, "impl": "fused", "window": 16, "warmup": 8}
    common |= {"sigma": 3.0, "steps": 300, "seed": 11}
    host = RECORDER.run("host", device=False, **common)
    device = RECORDER.run("device", device=True, **common)
    assert "0" in host["decisions"]  # the run skips: spikes, overflows
    assert host == device
