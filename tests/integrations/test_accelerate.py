"""accelerate and the HF Trainer with use_dscale, on 2 gloo ranks (accelerate's MULTI_CPU, DDP).

An inf lands in rank 1's grads only, at one step. With dscale every rank skips, the params stay
identical, the scale halves once, step_was_skipped says so (fused and sync-free included) and the
LR schedule holds; save_state/load_state resumes exactly. The same runs with torch's scaler put in
the way the issue found necessary show what goes wrong: ranks diverge, the schedule advances.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import dscale
from dscale.integrations import _support
from dscale.integrations.accelerate import use_dscale
from tests.integrations._frameworks import (
    INF_STEP,
    INIT_SCALE,
    STEPS,
    TinyNet,
    batch,
    flat_params,
    framework_env,
    poison,
)
from tests.multirank import run_ranks

OPTIMIZERS = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), False),
    "adamw_fused": (lambda p: torch.optim.AdamW(p, lr=0.01, fused=True), False),
    "sgd_sync_free": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), True),
}


def _accelerator(**kwargs: Any) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(mixed_precision="fp16", cpu=True, **kwargs)


def _fsdp2_accelerator() -> Any:
    """accelerate's own FSDP2 code (prepare, save_state, load_state) on CPU.

    accelerate picks FSDP for GPU-type setups only (``state.py`` leaves MULTI_CPU out), so the
    type is set after construction, where ACCELERATE_USE_FSDP sets it on GPUs. PartialState's
    copy too: every ``AcceleratorState()`` built later re-reads it.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = _accelerator(fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin  # with the mixed precision AcceleratorState sets on GPUs
    plugin.set_mixed_precision("fp16")
    assert acc.is_fsdp2
    return acc


def _setup(optimizer: str, scaler_kind: str, fsdp2: bool = False) -> tuple[Any, ...]:
    make_opt, sync_free = OPTIMIZERS[optimizer]
    acc = _fsdp2_accelerator() if fsdp2 else _accelerator()
    if scaler_kind == "dscale":
        use_dscale(acc, dscale.GradScaler("cpu", init_scale=INIT_SCALE, sync_free=sync_free))
    else:  # what it took before: two private assignments and torch's scaler
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        acc.native_amp = True
    model = TinyNet()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
    return acc, *acc.prepare(model, opt, sched)


def _train(rank: int, acc: Any, model: Any, opt: Any, sched: Any, steps: range) -> list[dict]:
    rows = []
    for step in steps:
        loss = model(batch(rank, step)).float().square().mean()
        acc.backward(loss)
        if rank == 1 and step == INF_STEP:
            poison(model)
        acc.clip_grad_norm_(model.parameters(), 10.0)  # unscales first
        opt.step()
        sched.step()
        opt.zero_grad()
        rows.append(
            {
                "skipped": opt.step_was_skipped,
                "scale": acc.scaler.get_scale(),
                "sched": sched.scheduler.last_epoch,
                "params": flat_params(model),
                "hidden": acc.unwrap_model(model).hidden_dtype,
            }
        )
    return rows


def _trainer_run(rank: int, tmp: str, scaler_kind: str, resume: bool = False) -> dict[str, Any]:
    """The HF Trainer, fp16, fused AdamW; saves a checkpoint after the skipped step.

    With ``resume``, a second Trainer resumes from that checkpoint and runs to the end.
    """
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyNet()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
            return {"loss": (self.net(x).squeeze(-1).float() - labels).square().mean()}

    data = [{"x": batch(0, i, rows=1)[0], "labels": batch(1, i, rows=1)[0, 0]} for i in range(64)]
    rows: list[dict] = []

    class PoisonOnRank1(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
            loss = super().training_step(model, inputs, num_items_in_batch)
            if rank == 1 and self.state.global_step == INF_STEP:
                poison(model)  # after backward (DDP reduced), before clipping and step
            return loss

    started: dict[str, Any] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            started["scaler"] = trainer.accelerator.scaler.state_dict()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            rows.append(
                {
                    "sched": trainer.lr_scheduler.last_epoch,
                    "lr": trainer.lr_scheduler.get_last_lr()[0],
                    "params": flat_params(model),
                }
            )

    args = TrainingArguments(
        output_dir=f"{tmp}/trainer-{scaler_kind}",
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        optim="adamw_torch_fused",  # the Trainer's default on GPU: step() runs on skipped steps
        fp16=True,
        use_cpu=True,
        report_to="none",
        save_strategy="steps",
        save_steps=INF_STEP + 1,
        save_only_model=False,
        logging_strategy="no",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        seed=0,
    )
    trainer = PoisonOnRank1(model=Regression(), args=args, train_dataset=data, callbacks=[Record()])
    if scaler_kind == "dscale":
        use_dscale(trainer.accelerator, dscale.GradScaler("cpu", init_scale=INIT_SCALE))
    else:
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        trainer.accelerator.native_amp = True
    checkpoint = f"{tmp}/trainer-{scaler_kind}/checkpoint-{INF_STEP + 1}"
    trainer.train(resume_from_checkpoint=checkpoint if resume else None)
    return {"rows": rows, "started": started, "checkpoint": checkpoint}


def _accelerate_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    framework_env(rank, world_size)
    out: dict[str, Any] = {}
    # accelerate on its own: fp16 on CPU quietly runs fp32 with no scaler.
    acc = _accelerator()
    model = acc.prepare(TinyNet())
    model(batch(rank, 0))
    out["plain"] = {"scaler": acc.scaler, "hidden": acc.unwrap_model(model).hidden_dtype}

    for name in OPTIMIZERS:
        out[f"dscale-{name}"] = _train(rank, *_setup(name, "dscale"), range(STEPS))
    out["torch-adamw_fused"] = _train(rank, *_setup("adamw_fused", "torch"), range(STEPS))

    # save_state after the skipped step, then resume in fresh objects: equal to the full run.
    acc, model, opt, sched = _setup("adamw_fused", "dscale")
    _train(rank, acc, model, opt, sched, range(INF_STEP + 1))
    acc.save_state(f"{tmp}/state")
    saved = acc.scaler.state_dict()
    acc, model, opt, sched = _setup("adamw_fused", "dscale")
    acc.load_state(f"{tmp}/state")
    out["resume"] = {
        "loaded": acc.scaler.state_dict(),
        "saved": saved,
        "rows": _train(rank, acc, model, opt, sched, range(INF_STEP + 1, STEPS)),
    }

    out["trainer-dscale"] = _trainer_run(rank, tmp, "dscale")
    out["trainer-torch"] = _trainer_run(rank, tmp, "torch")
    resumed = _trainer_run(rank, tmp, "dscale", resume=True)
    saved = torch.load(f"{resumed['checkpoint']}/scaler.pt", weights_only=True)
    out["trainer-resume"] = {**resumed, "saved": saved}
    out.update(_fsdp2_checks(rank, tmp))  # last: accelerate leaves ACCELERATE_USE_FSDP set

    # Bad input, on the way through: said once and passed through, or a clear error.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bf16 = _accelerator_bf16()
        use_dscale(bf16, dscale.GradScaler("cpu"))
        use_dscale(bf16, dscale.GradScaler("cpu"))
    out["bf16"] = {"scaler": bf16.scaler, "warnings": [str(w.message) for w in caught]}
    return out


def _fsdp2_checks(rank: int, tmp: str) -> dict[str, Any]:
    """FSDP2: the run, save_state/load_state resume, and optimizer loads before any backward.

    torch.distributed.checkpoint creates an empty optimizer's state with a zero-grad step(); under
    FSDP2 accelerate's load_state (and the HF Trainer's resume) make that step on a prepared
    optimizer, so through the scaler it counts as a training step.
    """
    from accelerate.utils import load_fsdp_optimizer

    out = {
        f"fsdp2-dscale-{name}": _train(rank, *_setup(name, "dscale", fsdp2=True), range(STEPS))
        for name in OPTIMIZERS
    }
    for kind in ("dscale", "torch"):  # accelerate's own FSDP2 scaler is torch's class
        acc, model, opt, sched = _setup("adamw_fused", kind, fsdp2=True)
        _train(rank, acc, model, opt, sched, range(INF_STEP + 1))
        acc.save_state(f"{tmp}/fsdp2-{kind}")
        saved = acc.scaler.state_dict()
        acc, model, opt, sched = _setup("adamw_fused", kind, fsdp2=True)
        acc.load_state(f"{tmp}/fsdp2-{kind}")
        loaded = acc.scaler.state_dict()
        rows = _train(rank, acc, model, opt, sched, range(INF_STEP + 1, STEPS))
        out[f"fsdp2-resume-{kind}"] = {"saved": saved, "loaded": loaded, "rows": rows}

        # The HF Trainer's resume: the optimizer is loaded first, the scaler after, fresh till then.
        acc, model, opt, _ = _setup("adamw_fused", kind, fsdp2=True)
        try:
            load_fsdp_optimizer(acc.state.fsdp_plugin, acc, opt, model, f"{tmp}/fsdp2-{kind}")
            out[f"fsdp2-optimizer-first-{kind}"] = {"scale": acc.scaler.get_scale(), "error": None}
        except (AssertionError, RuntimeError) as error:
            out[f"fsdp2-optimizer-first-{kind}"] = {"error": str(error)}
    return out


def _accelerator_bf16() -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(mixed_precision="bf16", cpu=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    # One spawn for every accelerate and Trainer check (a spawn costs seconds here).
    return run_ranks(_accelerate_checks, str(tmp_path_factory.mktemp("acc")), timeout_s=300)


SKIPS = [step == INF_STEP for step in range(STEPS)]


def _applied_so_far(skips: list[bool]) -> list[int]:
    return [sum(not s for s in skips[: i + 1]) for i in range(len(skips))]


def test_accelerate_alone_runs_fp16_on_cpu_as_fp32_without_a_scaler(runs) -> None:
    assert runs[0]["plain"] == {"scaler": None, "hidden": torch.float32}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("topology", ["ddp", "fsdp2"])
def test_every_rank_skips_when_only_rank_1_overflows_with_accelerate(
    runs, topology, optimizer
) -> None:
    prefix = "dscale" if topology == "ddp" else "fsdp2-dscale"
    rows = {rank: runs[rank][f"{prefix}-{optimizer}"] for rank in (0, 1)}
    for rank in (0, 1):
        assert [r["skipped"] for r in rows[rank]] == SKIPS, rank
        assert [r["scale"] for r in rows[rank]] == [
            INIT_SCALE if s < INF_STEP else INIT_SCALE / 2 for s in range(STEPS)
        ]
        # accelerate steps the scheduler once per process per applied step.
        assert [r["sched"] for r in rows[rank]] == [2 * n for n in _applied_so_far(SKIPS)]
        assert {r["hidden"] for r in rows[rank]} == {torch.float16}  # fp16 compute on CPU
    for a, b in zip(rows[0], rows[1], strict=True):
        assert a["params"] == b["params"]
    # the skipped step changed nothing
    assert rows[0][INF_STEP]["params"] == rows[0][INF_STEP - 1]["params"]


def test_torch_scaler_in_accelerate_lets_ranks_diverge_and_the_schedule_advance(runs) -> None:
    rows = {rank: runs[rank]["torch-adamw_fused"] for rank in (0, 1)}
    # rank 1 skipped its fused update, but accelerate reports it as applied...
    assert rows[1][INF_STEP]["params"] == rows[1][INF_STEP - 1]["params"]
    assert [r["skipped"] for r in rows[1]] == [False] * STEPS
    assert [r["sched"] for r in rows[1]] == [2 * (s + 1) for s in range(STEPS)]
    # ...and rank 0 applied it: the replicas are no longer the same model.
    assert rows[0][INF_STEP]["params"] != rows[1][INF_STEP]["params"]
    assert rows[0][INF_STEP]["scale"] == INIT_SCALE != rows[1][INF_STEP]["scale"]


@pytest.mark.parametrize(
    ("resume_run", "full_run"),
    [("resume", "dscale-adamw_fused"), ("fsdp2-resume-dscale", "fsdp2-dscale-adamw_fused")],
)
def test_accelerate_save_and_load_state_resume_exactly(runs, resume_run, full_run) -> None:
    for rank in (0, 1):
        resume = runs[rank][resume_run]
        assert resume["loaded"] == resume["saved"]  # FSDP2: not one step on (the DCP step)
        assert resume["saved"]["scale"] == INIT_SCALE / 2
        assert resume["saved"]["num_skipped_steps"] == 1
        assert (resume["saved"]["num_steps"], resume["saved"]["_growth_tracker"]) == (3, 0)
        full = runs[rank][full_run][INF_STEP + 1 :]
        for a, b in zip(resume["rows"], full, strict=True):
            assert a["params"] == b["params"]
            assert (a["scale"], a["sched"], a["skipped"]) == (b["scale"], b["sched"], b["skipped"])


def test_fsdp2_load_state_with_torch_scaler_counts_the_state_creating_step(runs) -> None:
    # DCP's zero-grad step went through torch's scaler: one growth step that never trained.
    for rank in (0, 1):
        resume = runs[rank]["fsdp2-resume-torch"]
        assert resume["saved"]["_growth_tracker"] == 0
        assert resume["loaded"]["_growth_tracker"] == 1


def test_fsdp2_optimizer_loads_before_the_first_backward(runs) -> None:
    for rank in (0, 1):
        assert runs[rank]["fsdp2-optimizer-first-dscale"] == {"scale": INIT_SCALE, "error": None}
        # torch's scaler refuses a step before its first scale(): the Trainer's resume fails.
        assert "_scale is None" in runs[rank]["fsdp2-optimizer-first-torch"]["error"]


def test_hf_trainer_holds_its_lr_schedule_on_the_skipped_step_with_fused_adamw(runs) -> None:
    for rank in (0, 1):
        rows = runs[rank]["trainer-dscale"]["rows"]
        assert [r["sched"] for r in rows] == _applied_so_far(SKIPS)
    pairs = zip(runs[0]["trainer-dscale"]["rows"], runs[1]["trainer-dscale"]["rows"], strict=True)
    for a, b in pairs:
        assert a["params"] == b["params"]
        assert a["lr"] == b["lr"]


def test_hf_trainer_with_torch_scaler_advances_the_schedule_and_ranks_diverge(runs) -> None:
    rows = {rank: runs[rank]["trainer-torch"]["rows"] for rank in (0, 1)}
    assert [r["sched"] for r in rows[1]] == list(range(1, STEPS + 1))
    assert rows[0][-1]["params"] != rows[1][-1]["params"]


def test_hf_trainer_resume_restores_the_scaler_and_continues_exactly(runs) -> None:
    for rank in (0, 1):
        resume = runs[rank]["trainer-resume"]
        assert resume["saved"]["scale"] == INIT_SCALE / 2
        assert resume["saved"]["num_skipped_steps"] == 1
        assert resume["started"]["scaler"] == resume["saved"]
        assert resume["rows"] == runs[rank]["trainer-dscale"]["rows"][INF_STEP + 1 :]


def test_bf16_accelerator_is_said_once_and_left_alone(runs) -> None:
    bf16 = runs[0]["bf16"]
    assert bf16["scaler"] is None
    said = [w for w in bf16["warnings"] if "mixed_precision='bf16'" in w]
    assert len(said) == 1, bf16["warnings"]


def test_use_dscale_refuses_torch_scaler_late_calls_and_wrong_device() -> None:
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(TypeError, match=r"takes a dscale\.GradScaler, got torch's GradScaler"):
        use_dscale(acc, torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"scaler device='meta'.*dscale.GradScaler\('cpu'"):
        use_dscale(acc, dscale.GradScaler("meta"))
    acc.prepare(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"after accelerator.prepare\(\)"):
        use_dscale(acc, dscale.GradScaler("cpu"))


def test_unsupported_accelerate_version_names_the_supported_range(monkeypatch) -> None:
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(
        metadata, "version", lambda name: "0.34.2" if name == "accelerate" else real(name)
    )
    supported = r"supports accelerate >=1\.15,<1\.16; found accelerate 0\.34\.2"
    with pytest.raises(RuntimeError, match=supported):
        use_dscale(object(), dscale.GradScaler("cpu"))


def test_disabled_scaler_is_said_once_and_passes_through() -> None:
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    _support._said.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use_dscale(acc, dscale.GradScaler("cpu", enabled=False))
        use_dscale(acc, dscale.GradScaler("cpu", enabled=False))
    assert acc.scaler is None
    assert len([w for w in caught if "disabled" in str(w.message)]) == 1


def test_prepared_optimizer_reports_from_dscale_and_pickles() -> None:
    import pickle

    from accelerate import Accelerator

    from dscale.integrations.accelerate import DScaleAcceleratedOptimizer

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    use_dscale(acc, dscale.GradScaler("cpu"))
    opt = acc.prepare(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    assert type(opt) is DScaleAcceleratedOptimizer
    assert opt.step_was_skipped is False  # not stepped yet
    assert type(pickle.loads(pickle.dumps(opt))) is DScaleAcceleratedOptimizer


def test_only_a_step_with_no_backward_since_the_last_bypasses_the_scaler() -> None:
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = dscale.GradScaler("cpu", init_scale=INIT_SCALE)
    use_dscale(acc, scaler)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_a, opt_b = acc.prepare(
        torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)
    )
    # One backward, two optimizers: both steps go through the scaler (accelerate updates it
    # after each), and the one whose grads hold the inf is skipped.
    acc.backward(second(first(torch.ones(2, 4))).sum())
    first.weight.grad[0, 0] = float("inf")
    before = first.weight.detach().clone()
    opt_a.step()
    opt_b.step()
    assert (opt_a.step_was_skipped, opt_b.step_was_skipped) == (True, False)
    assert torch.equal(first.weight, before)
    assert scaler.state_dict()["num_steps"] == 2
    # No backward since: the grads were never scaled, so the step is the optimizer's own.
    counted = scaler.state_dict()["num_steps"]
    second.weight.grad = torch.ones_like(second.weight)
    weight = second.weight.detach().clone()
    opt_b.step()
    assert torch.equal(second.weight, weight - 0.1)
    assert scaler.state_dict()["num_steps"] == counted


@pytest.mark.parametrize("kind", ["dscale", "torch"])
def test_limit_two_optimizers_behind_one_backward_unscale_with_the_backed_off_scale(kind) -> None:
    # accelerate updates the scaler after each prepared optimizer's step (the README's limit):
    # the first optimizer's inf halves the scale before the second unscales its grads.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    if kind == "dscale":
        use_dscale(acc, dscale.GradScaler("cpu", init_scale=INIT_SCALE))
    else:
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        acc.native_amp = True
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_a, opt_b = acc.prepare(
        torch.optim.SGD(first.parameters(), lr=1.0), torch.optim.SGD(second.parameters(), lr=1.0)
    )
    acc.backward(second(first(torch.ones(2, 4))).float().sum())
    true_grad = second.weight.grad / INIT_SCALE
    first.weight.grad[0, 0] = float("inf")
    weight = second.weight.detach().clone()
    opt_a.step()
    opt_b.step()
    assert torch.allclose(weight - second.weight, 2 * true_grad)
