"""The pieces of the run context that need no process group: entrypoints and the skip record."""

from __future__ import annotations

import pytest
import torch

import dscale
import launch.demo
from launch.entrypoint import EntrypointError, check_spec, load_entrypoint
from launch.record import SkipRecord


@pytest.mark.parametrize("spec", ["my_pkg.train", "my_pkg/train.py:main", ":main", "pkg:", "a:b c"])
def test_entrypoint_that_is_not_module_colon_function_is_refused(spec: str) -> None:
    with pytest.raises(EntrypointError, match=r"is not MODULE:FUNCTION; e\.g\. entrypoint="):
        check_spec(spec)


def test_entrypoint_loads_functions_and_names_what_is_missing() -> None:
    assert load_entrypoint("launch.demo:main") is launch.demo.main
    assert load_entrypoint("launch.record:SkipRecord.attach") is SkipRecord.attach  # dotted
    with pytest.raises(EntrypointError, match=r"'launch.demo' has no attribute 'mian' \(it has: "):
        load_entrypoint("launch.demo:mian")
    with pytest.raises(EntrypointError, match=r"not callable \(it is the int 4096\)"):
        load_entrypoint("launch.record:SKIP_CAPACITY")


def _iteration(scaler: dscale.GradScaler, optimizers: list, poison: list[bool]) -> None:
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    scaler.scale(sum(p.sum() for p in params)).backward()
    for opt, bad in zip(optimizers, poison):
        if bad:
            opt.param_groups[0]["params"][0].grad[0] = float("inf")
        scaler.step(opt)
    scaler.update()
    for opt in optimizers:
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph holds no float16")
def test_skip_record_notes_each_skipped_iteration_once_under_the_scalers_index() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizers = [torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)]
    scaler = dscale.GradScaler("cpu", init_scale=4.0)
    record = SkipRecord()
    record.attach(scaler)
    for poison in ([False, False], [True, True], [False, False], [False, True]):
        _iteration(scaler, optimizers, poison)
    # Step 2 skipped both optimizers (one entry); step 4 skipped through b only. Steps are
    # numbered from 1, as the progress line counts them; the checkpoint keeps 0-based indices.
    assert (record.skipped_steps, record.num_skipped) == ([2, 4], 2)
    assert record.state_dict()["skipped_steps"][:3].tolist() == [1, 3, -1]
    restored = SkipRecord()
    restored.load_state_dict(record.state_dict())
    assert (restored.skipped_steps, restored.num_skipped) == ([2, 4], 2)


def test_a_skip_record_saved_by_older_code_resumes_as_the_same_steps(caplog) -> None:
    # A checkpoint written before steps were numbered from 1 holds the same 0-based indices
    # (its log said "step 3 skipped" for the 4th step): it loads as step 4, and later skips
    # follow in the same numbering and are saved in the same format.
    old = {"skipped_steps": torch.full((4096,), -1, dtype=torch.int64), "num_skipped": 1}
    old["skipped_steps"][0] = 3
    record = SkipRecord()
    record.load_state_dict(old)
    with caplog.at_level("INFO", logger="launch.record"):
        record.record_skip(9)  # the scaler's 0-based index of the 10th step
    assert (record.skipped_steps, record.num_skipped) == ([4, 10], 2)
    assert "step 10 skipped" in caplog.text
    assert record.state_dict()["skipped_steps"][:3].tolist() == [3, 9, -1]


def test_skip_record_of_a_disabled_scaler_stays_empty() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    scaler = dscale.GradScaler("cpu", enabled=False)
    record = SkipRecord()
    record.attach(scaler)
    _iteration(scaler, [torch.optim.SGD([p], lr=0.1)], [False])
    assert (record.skipped_steps, record.num_skipped) == ([], 0)


def test_metrics_tensorboard_writes_the_loops_figures_at_each_report(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    import torch

    from launch import integrations
    from launch.progress import Progress

    calls: list[tuple] = []

    class FakeWriter:  # TensorBoard is not installed here; its SummaryWriter API is this much
        def __init__(self, log_dir: str) -> None:
            calls.append(("open", log_dir))

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            calls.append((tag, value, step))

        def close(self) -> None:
            calls.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    scaler = dscale.GradScaler("cpu")
    progress = Progress(10, 5, scaler, SkipRecord())
    cfg = {
        "enabled": True, "addr": "127.0.0.1", "port": 0, "linger_s": 0.0,
        "check_agreement_every": 0, "targets_dir": None, "tensorboard": True,
    }  # fmt: skip
    model = torch.nn.Linear(2, 1)
    with integrations.start_metrics(
        cfg, scaler, model, run_dir=tmp_path, rank=1, local_rank=1, log_every=5, progress=progress
    ):
        progress.update(4, 2.0, tokens=100)
        progress.update(9, 1.5, tokens=100)
    assert calls[0] == ("open", str(tmp_path / "tensorboard" / "rank1"))
    assert ("train_loss", 2.0, 4) in calls and ("train_loss", 1.5, 9) in calls
    assert ("train_step", 9.0, 9) in calls
    assert any(c[0] == "train_tokens_per_second" and c[2] == 9 for c in calls)
    assert calls[-1] == ("close",)
    assert progress.scalars is None  # nothing is written after the block


def test_metrics_tensorboard_without_tensorboard_is_a_bad_config(monkeypatch) -> None:
    import importlib.util

    from hydra import compose, initialize_config_dir
    from launch_helpers import CONFIGS
    from omegaconf import OmegaConf

    from launch.schema import register
    from launch.validate import ConfigError, validate

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "job", overrides=["checkpoint.dir=/tmp/dscale-tb", "metrics.tensorboard=true"]
        )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(ConfigError, match=r"metrics\.tensorboard=true needs TensorBoard"):
        validate(OmegaConf.to_object(cfg))


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))


class _ReturnsModuleList(_Layers):
    def blocks(self) -> torch.nn.ModuleList:  # what old code sharded: it iterated blocks()
        return self.layers


class _ReturnsGenerator(_Layers):
    def blocks(self):  # type: ignore[no-untyped-def]
        return (layer for layer in self.layers)


class _PropertyList(_Layers):
    @property
    def blocks(self) -> list[torch.nn.Module]:
        return list(self.layers)


@pytest.mark.parametrize("model", [_ReturnsModuleList, _ReturnsGenerator, _PropertyList])
def test_fsdp_blocks_of_a_method_returning_a_module_list_are_its_modules(model: type) -> None:
    """``def blocks(self): return self.layers`` (a ModuleList) shards each layer, as on main.

    The oracle is the attribute form, ``list(model.layers)``: the same modules, in order. i41d
    (4d7c75b) refused a method returning a ModuleList on every rank ("a method returning
    ModuleList"), a form d4d559b's ``for block in model.blocks()`` sharded block by block.
    """
    from launch.parallel import fsdp_blocks

    m = model()
    got = fsdp_blocks(m)
    assert len(got) == 3 and all(a is b for a, b in zip(got, m.layers, strict=True))
