"""The benchmark runs end to end on a tiny config and reports every arm of every scenario.

No timing assertions: speed is what the benchmark reports, not what tests check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
from collections import Counter

import pytest
import torch

from dscale.bench import _cli
from dscale.bench._arms import FLOOR, INIT_SCALE, make_optimizer, make_scaler
from dscale.bench._ranks import pin_to_own_core
from dscale.bench._report import render
from dscale.bench._syncs import count_host_syncs
from dscale.bench._timing import balanced_orders
from tests.multirank import run_ranks

STEP_ARMS = {"plain", "dscale", "torch", "torch_aa", "sharded", "floor"}
INTERVAL_KEYS = {"estimate", "low", "high", "verdict"}


def _finite_arm(arm: dict) -> None:
    for key in ("median_us", "min_us", "overhead_median_us", "overhead_min_us"):
        assert math.isfinite(arm[key]), (key, arm)
    assert arm["median_us"] > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "out.json"
    _cli.main(["--json", str(path), "--reps", "2", "--config-for-tests", "tiny"])
    return json.loads(path.read_text())


def test_every_single_process_scenario_has_every_arm(result) -> None:
    seen = {(s["count"], s["optimizer"], s["impl"]) for s in result["single"]}
    assert len(seen) == 8  # {many small, few large} x {sgd, adam} x {foreach, fused}
    for scenario in result["single"]:
        assert set(scenario["arms"]) == STEP_ARMS
        for arm in scenario["arms"].values():
            _finite_arm(arm)
            assert arm["reps"] == len(arm["paired_overheads_us"]) == 2
        assert set(scenario["ratios"]) == {
            "dscale/torch",
            "dscale/sharded",
            "torch_aa/torch",
            "floor/torch",
        }
        for interval in scenario["ratios"].values():
            assert set(interval) == INTERVAL_KEYS


def test_every_phase_of_every_scaler_is_reported(result) -> None:
    assert len(result["phases"]) == 2  # many small, few large
    for split in result["phases"]:
        assert set(split["scalers"]) == {"dscale", "torch", "sharded"}
        for per_phase in split["scalers"].values():
            assert set(per_phase) == {"unscale_", "step", "update"}
            assert all(math.isfinite(v["median_us"]) for v in per_phase.values())


def test_the_device_path_rows_compare_every_dscale_path_with_torch(result) -> None:
    rows = result["device_path"]
    assert {(s["count"], s["impl"]) for s in rows} == {
        (8, "fused"),
        (8, "foreach"),
        (200, "fused"),
        (200, "foreach"),
    }
    for s in rows:
        assert set(s["arms"]) >= {"dscale_device", "dscale_sync_free", "dscale_predictive"}
        assert "dscale_sync_free/torch" in s["ratios"] and "torch_aa/torch" in s["ratios"]


def test_unscale_pass_and_sweep_are_reported(result) -> None:
    for scenario in result["unscale_pass"]:
        assert set(scenario["arms"]) == {"foreach_mul", "dscale_unscale", "copy"}
        for arm in scenario["arms"].values():
            _finite_arm(arm)
        assert all(rate > 0 for rate in scenario["gb_per_s"].values())
    sweep = result["sweep"]
    assert [p["count"] for p in sweep["by_count"]] == _cli.CONFIGS["tiny"]["counts"]
    assert [p["numel"] for p in sweep["by_bytes"]] == _cli.CONFIGS["tiny"]["numels"]
    for slopes in sweep["slopes"].values():
        assert math.isfinite(slopes["us_per_tensor"]) and math.isfinite(slopes["us_per_mib"])


def test_two_rank_no_wrapper_ddp_and_fsdp2_arms_are_reported_with_an_aa_arm(result) -> None:
    dist_result = result["distributed"]
    assert dist_result["world_size"] == 2
    assert dist_result["pinned_to_own_cores"] is (len(os.sched_getaffinity(0)) >= 2)
    no_wrapper = dist_result["no_wrapper_steps"]
    assert [(s["count"], s["impl"]) for s in no_wrapper] == [(4, "foreach"), (4, "fused")]
    for scenario in no_wrapper:
        fused = scenario["impl"] == "fused"
        arms = {"plain", "dscale", "torch", "sharded", "sharded_aa", "floor"}
        ratios = {"dscale/sharded", "dscale/torch", "sharded_aa/sharded", "floor/sharded"}
        # Fused: ShardedGradScaler's ranks do not agree; the agreeing peer calls unscale_() first.
        assert set(scenario["arms"]) == arms | ({"sharded_unscaled"} if fused else set())
        unscaled = {"dscale/sharded_unscaled", "floor/sharded_unscaled"}
        assert set(scenario["ratios"]) == ratios | (unscaled if fused else set())
    peers = {"plain", "dscale", "sharded", "sharded_aa", "dscale+hook"}
    assert set(dist_result["ddp"]["arms"]) == peers | {"torch"}
    assert set(dist_result["fsdp2"]["arms"]) == peers
    for mode in ("ddp", "fsdp2"):
        for part in ("arms", "after_backward"):
            assert set(dist_result[mode][part]) == set(dist_result[mode]["arms"])
            for arm in dist_result[mode][part].values():
                _finite_arm(arm)
                assert arm["reps"] == 2
        for part in ("ratios", "after_backward_ratios"):
            assert "sharded_aa/sharded" in dist_result[mode][part]
            assert "dscale+hook/sharded" in dist_result[mode][part]


def test_the_report_prints_every_table_with_its_noise_verdict(result) -> None:
    text = render(result)
    # single, device path, no wrapper foreach and fused, ddp x2, fsdp2 x2 (the sweep: no A/A)
    assert text.count("noise (") == 8
    assert "load average:" in text and "percentile bootstrap" in text


def test_machine_info_and_load_are_written(result) -> None:
    assert result["machine"]["torch"]
    assert result["machine"]["device"] == "cpu"
    assert set(result["loadavg"]) == {"start", "end"}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"reps": 0}, "reps must be >= 1, got 0"),
        ({"device": "tpu"}, "device must be"),
        ({"config": "huge"}, "config must be one of"),
        ({"threads": 0}, "threads must be >= 1, got 0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        _cli.run(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts host syncs")
def test_sync_counter_sees_an_item_call_and_not_an_async_add() -> None:
    x = torch.ones((), device="cuda")
    assert count_host_syncs(lambda: x.item()) == 1
    assert count_host_syncs(lambda: x.add_(1)) == 0


def test_sync_counter_refuses_to_count_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        count_host_syncs(lambda: None)


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_arm_orders_put_every_arm_after_every_other_and_in_every_place_equally_often(n) -> None:
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    places = Counter((arm, place) for order in orders for place, arm in enumerate(order))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) == 1  # a fixed rotation fails here: one predecessor each
    assert len(places) == n * n and len(set(places.values())) == 1


def test_scenario_runs_only_the_rows_asked_for(tmp_path, capsys) -> None:
    path = tmp_path / "one.json"
    args = ["--json", str(path), "--reps", "2", "--scenario", "3x64:adam:fused"]
    _cli.main([*args, "--scenario", "2X32:sgd:foreach"])
    out = json.loads(path.read_text())
    rows = [(s["count"], s["numel"], s["optimizer"], s["impl"]) for s in out["single"]]
    assert rows == [(3, 64, "adam", "fused"), (2, 32, "sgd", "foreach")]
    assert {"phases", "unscale_pass", "sweep", "distributed"}.isdisjoint(out)
    assert "torch_aa/torch" in capsys.readouterr().out  # the table with its A/A arm


def test_device_path_runs_only_the_device_rows(tmp_path, capsys) -> None:
    path = tmp_path / "device.json"
    _cli.main(["--json", str(path), "--reps", "2", "--device-path"])
    out = json.loads(path.read_text())
    rows = [(s["count"], s["impl"]) for s in out["device_path"]]
    assert rows == [(8, "fused"), (8, "foreach"), (200, "fused"), (200, "foreach")]
    assert {"single", "phases", "unscale_pass", "sweep", "distributed"}.isdisjoint(out)
    assert "dscale_device/torch" in capsys.readouterr().out
    for s in out["device_path"]:  # issue 34's ratio: predictive's overhead over the dynamic one
        assert set(s["ratios"]["dscale_predictive/dscale_device"]) >= INTERVAL_KEYS


@pytest.mark.parametrize("bad", ["8x4:sgd", "8:sgd:fused", "0x4:sgd:fused", "8x4:lamb:fused"])
def test_a_malformed_scenario_is_refused_with_the_format(bad) -> None:
    with pytest.raises(SystemExit):
        _cli.main(["--scenario", bad])
    with pytest.raises(argparse.ArgumentTypeError, match="COUNT"):
        _cli.parse_scenario(bad)


def _pin_and_report(rank: int, world_size: int) -> tuple[int | None, set[int]]:
    return pin_to_own_core(rank, world_size), os.sched_getaffinity(0)


def test_each_rank_is_pinned_to_a_core_of_its_own_only_when_there_are_enough() -> None:
    cores = sorted(os.sched_getaffinity(0))
    # A fresh process for each call: never pin the test process, nor reuse a pinned worker.
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        if len(cores) >= 2:
            assert pool.apply(_pin_and_report, (1, 2)) == (cores[1], {cores[1]})
        # More ranks than cores: nothing is pinned, the process keeps every core it had.
        assert pool.apply(_pin_and_report, (0, len(cores) + 1)) == (None, set(cores))


def _floor_against(peer, floor, optimizer: str, impl: str, inf_on_rank: int | None, rank: int):
    """Params of ``peer`` and of the floor arm after three steps, the third with an inf."""
    outcomes = []
    for scaler in (peer, floor):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 300, 7)]
        opt = make_optimizer(params, optimizer, impl)
        history = []
        for step in range(3):
            for param in params:
                param.grad = torch.randn(param.shape) * INIT_SCALE
            if step == 2 and rank == inf_on_rank:
                params[1].grad[5] = float("inf")
            scaler.step(opt)
            scaler.update()
            history.append([p.detach().clone() for p in params])
        outcomes.append(history)
    return outcomes


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_floor_arm_does_torchs_work_and_skips_as_torch_does(optimizer, impl) -> None:
    """The floor is only a floor if it computes what torch's scaler computes, skip included."""
    cpu = torch.device("cpu")
    peer, floor = _floor_against(
        make_scaler("torch", cpu), make_scaler(FLOOR, cpu), optimizer, impl, 0, 0
    )
    for step, (want, got) in enumerate(zip(peer, floor, strict=True)):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), (step, optimizer, impl)
    assert all(torch.equal(a, b) for a, b in zip(floor[1], floor[2], strict=True))  # skipped


def _floor_on_ranks(rank: int, world_size: int) -> list[bool]:
    cpu = torch.device("cpu")
    same = []
    for impl in ("foreach", "fused"):
        # ShardedGradScaler agrees through unscale_(); the floor's all-reduce must match it.
        sharded = make_scaler("sharded", cpu)
        unscale_then_step = sharded.step

        def step(opt, _sharded=sharded, _step=unscale_then_step):
            _sharded.unscale_(opt)
            return _step(opt)

        sharded.step = step
        peer, floor = _floor_against(sharded, make_scaler(FLOOR, cpu), "sgd", impl, 1, rank)
        same.append(
            all(torch.equal(a, b) for w, g in zip(peer, floor) for a, b in zip(w, g))
            and all(torch.equal(a, b) for a, b in zip(floor[1], floor[2]))
        )
    return same


def test_the_floor_arm_agrees_across_ranks_as_sharded_grad_scaler_does() -> None:
    """An inf on rank 1 only: the floor skips on both ranks, as ShardedGradScaler after unscale_."""
    assert run_ranks(_floor_on_ranks, world_size=2) == {0: [True, True], 1: [True, True]}
