"""The op-count benchmark: its counter counts what it says, and the scalers meet the targets.

Op counts are deterministic, so unlike timings they can be held in CI: on the device-side decision
path (forced on the CPU, as a CUDA run takes it) dscale's dynamic fused step launches no more ops
than torch's scaler, ``sync_free`` at most twice torch's, and neither grows with the number of
parameters; none of them reads the device from the host.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dscale
from dscale.bench import _ops, _ops_guard
from dscale.bench._op_count import count_ops
from dscale.bench._ops_cli import check_targets


def test_the_counter_counts_kernels_and_host_reads_and_leaves_views_out() -> None:
    x = torch.ones(4)
    assert count_ops(lambda: x.add_(1)).num_kernels == 1
    assert count_ops(lambda: (x.view(2, 2), x[1:], x.reshape(-1))).num_kernels == 0
    assert count_ops(lambda: torch.empty(3)).num_kernels == 0
    assert count_ops(lambda: torch.zeros(3)).num_kernels == 1
    assert count_ops(lambda: x.sum().item(), host_only=True).host_reads == 1
    assert count_ops(lambda: x.tolist(), host_only=True).host_reads == 1
    assert count_ops(lambda: torch._foreach_mul_([x, x.clone()], 2.0)).kernels["_foreach_mul_"] == 1


def test_a_scaler_with_a_loop_over_the_parameters_would_show_in_the_counts() -> None:
    """The check has teeth: an update done per tensor grows with the parameter count."""
    for count in (8, 200):
        row = _ops.Row("sgd", "foreach", count)
        setup = _ops._Setup(row, torch.device("cpu"))
        ops = count_ops(lambda s=setup: [g.mul_(1.0) for g in s.saved]).num_kernels
        assert ops == count


@pytest.mark.parametrize("optimizer", ["sgd-stateless", "adamw-frozen"])
def test_sync_free_keeps_its_flat_path_for_parameters_without_state(optimizer: str) -> None:
    """Issue 33 item 4: SGD without momentum (no state at all) and AdamW with one frozen
    parameter (no grad, never any state) left the flat snapshot for a per-tensor undo, three ops
    per tensor (8 -> 200 parameters: 35 -> 611 and 110 -> 2414 ops). Oracle: the same scaler at
    8 parameters, and torch's scaler on the same rows."""
    cpu = torch.device("cpu")
    counts = {}
    for params in (8, 200):
        row = _ops.Row(optimizer, "foreach", params)
        counts[params] = _ops.measure("dscale_sync_free", row, cpu)
        theirs = _ops.measure("torch", row, cpu)
        assert counts[params]["kernels"] <= 2 * theirs["kernels"], (row, counts, theirs)
        assert counts[params]["host_reads"] == 0, (row, counts)
    assert counts[8] == counts[200]
    names = {row.name for row in _ops.rows()}  # and the benchmark's table shows them
    assert {f"{optimizer} foreach x8", f"{optimizer} foreach x200"} <= names


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of ``python -m dscale.bench ops --no-compiled --json``: its single-process and
    StepGuard tables are what ``run_single`` and ``run_guard`` return in this process (the CLI
    calls them with the same arguments), so the tests below read them instead of counting twice.
    The compiled column has its own test (tests/test_bench_ops_compiled.py)."""
    out = tmp_path_factory.mktemp("ops") / "ops.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dscale.bench", "ops", "--no-compiled", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,  # 576 s seen at load average 15 on 2 shared cores
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"stdout": proc.stdout, "json": json.loads(out.read_text())}


@pytest.fixture(scope="module")
def single(cli: dict) -> dict:
    return cli["json"]["single"]


def test_every_dynamic_and_sync_free_target_is_met_in_a_single_process(single) -> None:
    checks = [c for c in check_targets(single) if "predictive" not in c["target"]]
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


def test_fused_dynamic_launches_fewer_ops_than_torch_and_reads_nothing(single) -> None:
    for name, arms in single.items():
        if "fused" in name:
            assert arms["dscale"]["kernels"] < arms["torch"]["kernels"], name
            assert arms["dscale"]["host_reads"] == 0, name


def test_predictive_is_within_six_ops_of_torch_at_any_parameter_count(single) -> None:
    # The measurement (4 ops) and the two-ring rule (6, with torch's update left out): torch's
    # count + 6 on the device path (issue 23's target), and no host read.
    for shape in ("sgd foreach", "sgd fused", "adamw foreach", "adamw fused"):
        small, large = single[f"{shape} x8"], single[f"{shape} x200"]
        assert small["dscale_predictive"] == large["dscale_predictive"], shape
        assert large["dscale_predictive"]["kernels"] <= large["torch"]["kernels"] + 6, shape
        if "fused" in shape:
            assert large["dscale_predictive"]["host_reads"] == 0, shape


def test_the_cli_runs_two_ranks_and_writes_json(cli: dict) -> None:
    assert "2 gloo ranks" in cli["stdout"] and "targets:" in cli["stdout"]
    result = cli["json"]
    ranks = result["ranks2"]
    for name, arms in ranks.items():
        for arm in ("dscale", "dscale_sync_free", "dscale_predictive"):
            assert arms[arm]["collectives"] == 1, (name, arm)  # the one agreement all-reduce
        # attach(): DDP's reduction made the hooks' flag global, but step() checks the hooked
        # grads again (a write through .data may be on one rank only), so the agreement runs.
        assert arms["dscale_attach"]["collectives"] == 1, name
    # Issue 34's "gate <= guard + 10" is reported, not held: the gate adds 20 ops (see
    # test_the_spike_gate_adds_at_most_20_ops...); every other target must be met.
    open_target = f"gate <= guard + {_ops_guard.GATE_EXTRA_OPS}"
    missed = [c for c in result["targets"] if not c["ok"] and open_target not in c["target"]]
    assert not missed, missed
    assert any("attach <= torch" in c["target"] for c in result["targets"])
    assert set(result["step_guard"]) == set(result["single"])


@pytest.fixture(scope="module")
def guard_rows(cli: dict) -> dict:
    return cli["json"]["step_guard"]


def test_the_spike_gate_adds_at_most_20_ops_to_a_step_guard(guard_rows) -> None:
    # Two window matrices in turn with the factors and counters as rows, the local values by one
    # stack + mm, the merge into the skip flag inside decide() (written where the host's read of
    # the agreed vector brings it): 20 ops over the guard's, fused and foreach. 8b59196's gate
    # added 27-28, e6f0fe2's 74-76. Issue 34 asks for 10: not met, see docs/step-guard.md.
    for name, arms in guard_rows.items():
        extra = arms["gate"]["kernels"] - arms["guard"]["kernels"]
        assert extra <= 20, (name, extra)


def test_the_gate_count_depends_on_neither_the_window_nor_the_parameter_count(guard_rows) -> None:
    checks = [c for c in _ops_guard.check_guard_targets(guard_rows) if "independent" in c["target"]]
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


def test_force_device_decision_is_the_seam_the_tests_use() -> None:
    scaler = dscale.GradScaler("cpu")
    _ops.force_device_decision(scaler)
    assert scaler._read_host_flags is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts reads of GPU memory")
def test_on_cuda_the_device_path_reads_no_gpu_memory_and_launches_no_more_than_torch() -> None:
    cuda = torch.device("cuda")
    for row in (_ops.Row("adamw", "fused", 200), _ops.Row("sgd", "foreach", 200)):
        theirs = _ops.measure("torch", row, cuda)
        for arm in ("dscale", "dscale_sync_free"):
            ours = _ops.measure(arm, row, cuda)
            if arm == "dscale" and row.impl == "foreach":
                assert ours["host_reads"] == theirs["host_reads"] == 1  # the skip decision
                continue
            assert ours["host_reads"] == 0, (row, arm, ours)
            assert ours["kernels"] <= 2 * theirs["kernels"], (row, arm, ours, theirs)
