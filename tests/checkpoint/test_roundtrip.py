"""Single-process save/load: what comes back, what is kept, async saves, torch scaler files."""

from __future__ import annotations

import random

import pytest
import torch

from dscale.checkpoint import CheckpointManager, load_scaler_file
from tests.checkpoint._helpers import make_model, make_scaler, optim_state, params, train


def _setup(seed: int = 0):
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, make_scaler()


def test_roundtrip_restores_model_optimizer_scaler_step_and_rng(tmp_path):
    model, opt, scaler = _setup()
    train(model, opt, scaler, 5)
    ckpt = CheckpointManager(tmp_path, keep=2)
    torch.manual_seed(123)
    random.seed(7)
    ckpt.save(5, model=model, optimizer=opt, scaler=scaler)
    expected_rng = (torch.rand(3), random.random())

    model2, opt2, scaler2 = _setup(seed=99)
    step = CheckpointManager(tmp_path).resume("auto", model=model2, optimizer=opt2, scaler=scaler2)

    assert step == 5
    for name, value in params(model).items():
        torch.testing.assert_close(params(model2)[name], value, rtol=0, atol=0)
    torch.testing.assert_close(optim_state(model2, opt2), optim_state(model, opt), rtol=0, atol=0)
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler.get_scale() != 1024.0  # the run moved the scale, so the check means something
    assert torch.equal(torch.rand(3), expected_rng[0])
    assert random.random() == expected_rng[1]
    # Both continue identically (dropout draws from the one global RNG, so give each the same).
    rng = torch.get_rng_state()
    train(model, opt, scaler, 2, seed=5)
    torch.set_rng_state(rng)
    train(model2, opt2, scaler2, 2, seed=5)
    assert torch.equal(params(model)["0.weight"], params(model2)["0.weight"])


def test_every_and_keep_publish_only_the_newest_checkpoints(tmp_path):
    model, opt, scaler = _setup()
    ckpt = CheckpointManager(tmp_path, every=2, keep=2)
    saved = [ckpt.maybe_save(s, model=model, optimizer=opt, scaler=scaler) for s in range(1, 8)]
    assert saved == [False, True, False, True, False, True, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]
    names = sorted(p.name for p in (tmp_path / "step-6").iterdir())
    assert names[:2] == [".metadata", "__0_0.distcp"]  # one data file per writer thread
    assert all(n.startswith("__0_") and n.endswith(".distcp") for n in names[1:-2])
    assert names[-2:] == ["checksums.crc32", "dscale.json"]
    assert ckpt.latest() == tmp_path / "step-6"


def test_resume_with_nothing_saved_returns_none(tmp_path):
    model, opt, scaler = _setup()
    ckpt = CheckpointManager(tmp_path / "empty")
    assert ckpt.resume("auto", model=model, optimizer=opt, scaler=scaler) is None
    assert ckpt.resume(None, model=model) is None


def test_async_save_is_published_by_wait_and_loads(tmp_path):
    model, opt, scaler = _setup()
    train(model, opt, scaler, 4)
    ckpt = CheckpointManager(tmp_path, async_save=True)
    ckpt.save(4, model=model, optimizer=opt, scaler=scaler)
    before = params(model)
    train(model, opt, scaler, 1)  # changes after save() returned must not leak into step-4
    ckpt.wait()
    assert (tmp_path / "step-4" / "checksums.crc32").is_file()
    model2, opt2, scaler2 = _setup(seed=3)
    assert ckpt.load(tmp_path / "step-4", model=model2, optimizer=opt2, scaler=scaler2) == 4
    assert torch.equal(params(model2)["3.weight"], before["3.weight"])


def test_torch_scaler_state_saved_with_torch_save_loads(tmp_path):
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7)
    torch_scaler.load_state_dict({**torch_scaler.state_dict(), "_growth_tracker": 3})
    torch.save(torch_scaler.state_dict(), tmp_path / "scaler.pt")

    scaler = make_scaler()
    load_scaler_file(scaler, tmp_path / "scaler.pt")

    assert scaler.get_scale() == 256.0
    assert scaler.get_growth_interval() == 7
    assert scaler.state_dict()["_growth_tracker"] == 3


def test_checkpoint_of_torch_scaler_loads_into_dscale_scaler_and_back(tmp_path):
    model, opt, _ = _setup()
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    CheckpointManager(tmp_path).save(1, model=model, optimizer=opt, scaler=torch_scaler)
    scaler = make_scaler(init_scale=2.0)
    CheckpointManager(tmp_path).resume("auto", model=model, optimizer=opt, scaler=scaler)
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize(("kwargs", "name"), [({"every": -1}, "every"), ({"keep": 0}, "keep")])
def test_bad_manager_arguments_name_the_argument(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        CheckpointManager(tmp_path, **kwargs)


def test_bad_save_arguments_name_the_argument_and_write_nothing(tmp_path):
    model, opt, scaler = _setup()
    ckpt = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="optimizer was given without model"):
        ckpt.save(1, optimizer=opt)
    with pytest.raises(ValueError, match="extra has the key 'scaler'"):
        ckpt.save(1, model=model, extra={"scaler": scaler})
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        ckpt.save(1, model=model, optimizer=object())
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_optimizer_param_groups_are_saved_by_parameter_name_and_the_positional_layout_loads(
    tmp_path, monkeypatch
):
    """Param groups are keyed by parameter name (``optimizer.param_groups.<fqn>.lr``): keyed by
    position, pipeline stages all wrote ``param_groups.0.*`` and DCP kept one stage's (a resumed
    AdamW stage failed with KeyError 'betas'). A checkpoint of the positional layout, as dscale
    wrote it before, still loads, groups and state alike."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from dscale.checkpoint import _states

    def setup(seed):
        model = make_model(seed)
        weights, biases = (
            [p for n, p in model.named_parameters() if n.endswith(kind)]
            for kind in ("weight", "bias")
        )
        opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "lr": 3e-3}], lr=1e-2)
        return model, opt

    def saved_keys(folder):
        return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)

    model, opt = setup(0)
    train(model, opt, make_scaler(), 3)
    CheckpointManager(tmp_path / "by_name").save(3, model=model, optimizer=opt)
    keys = saved_keys(tmp_path / "by_name" / "step-3")
    assert {"optimizer.param_groups.0.weight.lr", "optimizer.param_groups.0.bias.betas"} <= keys
    assert not [k for k in keys if k.startswith("optimizer.param_groups.0.params")]

    positional = lambda self: get_optimizer_state_dict(self.model, self.optimizer)  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(_states.OptimizerState, "state_dict", positional)
        CheckpointManager(tmp_path / "by_position").save(3, model=model, optimizer=opt)
    assert "optimizer.param_groups.0.params" in saved_keys(tmp_path / "by_position" / "step-3")

    for layout in ("by_name", "by_position"):
        model2, opt2 = setup(99)
        train(model2, opt2, make_scaler(), 1)  # state of other values, to be overwritten
        opt2.param_groups[1]["lr"] = 1.0
        assert (
            CheckpointManager(tmp_path / layout).resume("auto", model=model2, optimizer=opt2) == 3
        )
        torch.testing.assert_close(
            optim_state(model2, opt2), optim_state(model, opt), rtol=0, atol=0
        )
        assert [g["lr"] for g in opt2.param_groups] == [1e-2, 3e-3], layout
