"""Lightning Trainer and Fabric with dscale's plugins, on 2 gloo ranks (one spawn for all of it).

An inf lands in rank 1's grads only, at one step. With dscale every rank skips, params stay
identical, the scale halves once, the LR schedule holds, and the scaler state survives a
save/resume. The same runs with Lightning's own plugin and torch's scaler show what goes wrong.

What runs here (CPU): Fabric and the Trainer under DDP, ModelParallelStrategy (FSDP2) and
FSDPStrategy (FSDP1), and "16-true" master weights. Lightning refuses its FSDP strategy on the
CPU; a subclass that changes nothing passes that check, and the model is wrapped in FSDP1 before
Lightning sees it, since Lightning's own wrapping names no CPU device.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import dscale
from dscale.integrations import _support
from tests.integrations._frameworks import INF_STEP, INIT_SCALE, STEPS, same_state
from tests.integrations._lightning_ranks import lightning_checks
from tests.multirank import run_ranks

SCALES = [INIT_SCALE if step < INF_STEP else INIT_SCALE / 2 for step in range(STEPS)]
HELD = [step + (step < INF_STEP) for step in range(STEPS)]  # schedule steps: held at INF_STEP
ADVANCED = list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return run_ranks(lightning_checks, str(tmp_path_factory.mktemp("lightning")), timeout_s=300)


def _rows(runs: dict, key: str, rank: int) -> list[dict]:
    value = runs[rank][key]
    return value["rows"] if isinstance(value, dict) else value


def _same_params_across_ranks(runs: dict, key: str) -> list[bool]:
    return [a["params"] == b["params"] for a, b in zip(_rows(runs, key, 0), _rows(runs, key, 1))]


DSCALE_RUNS = [
    "fabric-ddp-dscale",
    "fabric-fsdp2-dscale",
    "fabric-fsdp1-dscale",
    "fabric-masters",
    "trainer-dscale",
    "trainer-fsdp2",
    "trainer-fsdp1",
    "trainer-masters",
]


@pytest.mark.parametrize("run", DSCALE_RUNS)
def test_every_rank_skips_when_only_rank_1_overflows_in_lightning(runs, run: str) -> None:
    assert _same_params_across_ranks(runs, run) == [True] * STEPS
    for rank in (0, 1):
        rows = _rows(runs, run, rank)
        assert [r["scale"] for r in rows] == SCALES, rank
        if "sched" in rows[0]:
            assert [r["sched"] for r in rows] == HELD, rank
        if "skipped" in rows[0]:
            assert [r["skipped"] for r in rows] == [s == INF_STEP for s in range(STEPS)]
        if "hidden" in rows[0]:
            assert {r["hidden"] for r in rows} == {torch.float16}  # autocast on the CPU
        assert rows[INF_STEP]["params"] == rows[INF_STEP - 1]["params"]  # nothing moved


@pytest.mark.parametrize("run", ["fabric-ddp-torch", "trainer-torch"])
def test_torch_scaler_in_lightning_ddp_lets_ranks_diverge(runs, run: str) -> None:
    same = _same_params_across_ranks(runs, run)
    assert same[:INF_STEP] == [True] * INF_STEP
    assert same[INF_STEP:] == [False] * (STEPS - INF_STEP)
    assert _rows(runs, run, 0)[INF_STEP]["scale"] == INIT_SCALE  # rank 0 never saw the inf
    assert _rows(runs, run, 1)[INF_STEP]["scale"] == INIT_SCALE / 2
    # The Trainer steps the schedule on the skipped step too (Fabric: the user cannot tell).
    assert [r["sched"] for r in _rows(runs, run, 1)] == ADVANCED


@pytest.mark.parametrize("arm", ["ddp-dscale", "fsdp2-dscale", "fsdp1-dscale"])
def test_fabric_save_and_load_restore_the_scaler(runs, arm: str) -> None:
    for rank in (0, 1):
        out = runs[rank][f"fabric-{arm}"]
        assert out["scaler_in_state"] == "GradScaler"
        assert out["loaded"] == out["saved"]
        assert out["saved"]["num_skipped_steps"] == 1


@pytest.mark.parametrize("arm", ["fsdp2-torch", "fsdp1-lightning"])
def test_lightning_sharded_load_hands_back_a_dict_instead(runs, arm: str) -> None:
    # Lightning's own ModelParallelStrategy and FSDPStrategy (sharded checkpoints): the scaler is
    # replaced by its saved dict in `state` and the object itself keeps its fresh scale.
    out = runs[0][f"fabric-{arm}"]
    assert out["scaler_in_state"] == "dict"
    assert out["loaded"]["scale"] == 2.0**16 != out["saved"]["scale"]


def test_fabric_master_weights_checkpoint_holds_fp32_masters_and_the_scaler(runs) -> None:
    for rank in (0, 1):
        out = runs[rank]["fabric-masters"]
        assert out["loaded_equals_saved"]
        assert out["masters_are_fp32"] == torch.float32
        assert out["scaler"]["scale"] == INIT_SCALE / 2
        assert out["scaler"]["num_skipped_steps"] == 1
    assert runs[0]["trainer-masters"]["dtype"] == torch.float16


@pytest.mark.parametrize(
    ("resume_run", "full_run"), [("ddp", "dscale"), ("fsdp2", "fsdp2"), ("fsdp1", "fsdp1")]
)
def test_trainer_checkpoint_resume_restores_the_scaler_and_continues_exactly(
    runs, resume_run: str, full_run: str
) -> None:
    for rank in (0, 1):
        resume = runs[rank][f"trainer-{resume_run}-resume"]
        saved = resume["in_checkpoint"]  # DDP: under the plugin's class name, as Lightning's
        assert saved["scale"] == INIT_SCALE / 2
        assert saved["num_skipped_steps"] == 1
        assert resume["loaded"] == saved
        full = runs[rank][f"trainer-{full_run}"][INF_STEP + 1 :]
        assert resume["rows"] == full


def test_lightning_fsdp_precision_has_no_scaler_and_the_inf_reaches_the_weights(runs) -> None:
    lightning = runs[0]["trainer-fsdp1-lightning"]
    # It refuses any scaler it is given and builds torch's ShardedGradScaler, off on the CPU.
    assert (lightning["scaler"], lightning["scaler_enabled"]) == ("ShardedGradScaler", False)
    assert [r["finite"] for r in lightning["rows"]] == [step < INF_STEP for step in range(STEPS)]
    assert all(r["finite"] for r in _rows(runs, "trainer-fsdp1", 0))


def test_trainer_master_weights_resume_restores_masters_and_scaler_exactly(runs) -> None:
    for rank in (0, 1):
        resume = runs[rank]["trainer-masters-resume"]
        saved = resume["in_checkpoint"]["fp16_optimizers"][0]
        assert saved["fp32_from_fp16"][0][0].dtype == torch.float32
        assert saved["scaler"]["scale"] == INIT_SCALE / 2
        full = runs[rank]["trainer-masters"]["rows"][INF_STEP + 1 :]
        assert resume["rows"] == full
        assert same_state(resume["loaded"], resume["in_checkpoint"])


# ----------------------------------------------------------------- single-process checks
def test_plugins_refuse_torch_scaler_and_missing_scaler() -> None:
    from dscale.integrations import fabric, lightning

    for module in (fabric, lightning):
        with pytest.raises(TypeError, match=r"takes a dscale\.GradScaler, got torch's"):
            module.MixedPrecision(torch.amp.GradScaler("cpu"))
        with pytest.raises(ValueError, match=r"'16-mixed' needs a scaler"):
            module.FSDPPrecision(None)
        with pytest.raises(ValueError, match=r"precision='8-true' is not an FSDP precision"):
            module.FSDPPrecision(dscale.GradScaler("cpu"), precision="8-true")


def test_fsdp_plugins_keep_the_scaler_and_autocast_on_its_device() -> None:
    from dscale.integrations import fabric, lightning

    for module in (fabric, lightning):
        scaler = dscale.GradScaler("cpu")
        plugin = module.FSDPPrecision(scaler)
        assert plugin.scaler is scaler
        assert plugin.state_dict() == scaler.state_dict()
        with plugin.forward_context():
            assert torch.get_autocast_dtype("cpu") == torch.float16
            assert torch.is_autocast_enabled("cpu")


def test_bf16_and_disabled_scalers_are_said_once_and_pass_through() -> None:
    from dscale.integrations import fabric, lightning

    _support._said.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            bf16 = lightning.MixedPrecision(dscale.GradScaler("cpu"), precision="bf16-mixed")
            off = fabric.MixedPrecision(dscale.GradScaler("cpu", enabled=False))
    messages = [str(w.message) for w in caught if "dscale" in str(w.message)]
    assert len([m for m in messages if "'bf16-mixed' needs no loss scaler" in m]) == 1
    assert len([m for m in messages if "disabled" in m]) == 1
    assert bf16.scaler is None and bf16.precision == "bf16-mixed"
    assert off.scaler.is_enabled() is False  # kept: it passes every step through


def test_unsupported_lightning_version_names_the_supported_range(monkeypatch) -> None:
    from importlib import metadata

    from dscale.integrations._lightning_common import require_lightning

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda n: "2.3.3" if n == "lightning" else real(n))
    supported = r"supports lightning >=2\.6,<2\.7; found lightning 2\.3\.3"
    with pytest.raises(RuntimeError, match=supported):
        require_lightning()
