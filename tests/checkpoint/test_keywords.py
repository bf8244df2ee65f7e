"""CheckpointManager's methods name their keywords: a misspelt one is refused, never ignored."""

from __future__ import annotations

import inspect

import pytest
import torch

from dscale.checkpoint import CheckpointManager

_KEYWORDS = ["model", "optimizer", "scaler", "extra"]
_METHODS = ["save", "maybe_save", "load", "load_latest", "resume", "check_room"]


@pytest.mark.parametrize("method", _METHODS)
def test_every_manager_method_shows_model_optimizer_scaler_and_extra(method: str) -> None:
    """help(ckpt.resume) lists the keywords it takes, instead of hiding them in **states."""
    params = inspect.signature(getattr(CheckpointManager, method)).parameters.values()
    assert not [p for p in params if p.kind is p.VAR_KEYWORD]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert keyword_only == _KEYWORDS


def test_a_misspelt_keyword_is_refused_even_when_there_is_nothing_to_resume(tmp_path) -> None:
    """resume("auto", extras=...) on an empty folder used to return None and drop the typo."""
    model = torch.nn.Linear(2, 1)
    ckpt = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="extras"):
        ckpt.resume("auto", model=model, extras={"data": model})
    with pytest.raises(TypeError, match="scalar"):
        ckpt.load_latest(model=model, scalar=None)
    assert not (tmp_path / "ckpt").exists()


def test_extra_round_trips_through_save_and_resume(tmp_path) -> None:
    """An extra= Stateful comes back through resume(); the oracle is the state saved."""

    class Position:
        def __init__(self, index: int) -> None:
            self.index = index

        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"index": torch.tensor(self.index)}

        def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
            self.index = int(state["index"])

    model = torch.nn.Linear(2, 1)
    CheckpointManager(tmp_path).save(7, model=model, extra={"data": Position(123)})
    back = Position(0)
    step = CheckpointManager(tmp_path).resume("auto", model=model, extra={"data": back})
    assert (step, back.index) == (7, 123)


def test_an_extra_under_another_name_is_refused_naming_the_saved_ones(tmp_path) -> None:
    """resume(extra={"sched": s}) of a checkpoint saved with extra={"schedule": s}: the refusal
    names the extras the checkpoint holds (DCP's "Missing key in checkpoint state_dict:
    sched.step_size" named neither the saved name nor the fix), and nothing is loaded."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    CheckpointManager(tmp_path).save(4, model=model, extra={"schedule": schedule})
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    changed = model.weight.detach().clone()
    again = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.5), 5)
    with pytest.raises(ValueError, match=r"extra\['sched'\].*holds extras: 'schedule'") as exc:
        CheckpointManager(tmp_path).resume("auto", model=model, extra={"sched": again})
    assert "pass extra= with the names the run saved" in str(exc.value).lower()
    assert torch.equal(model.weight, changed) and not torch.equal(model.weight, weight)
    assert again.step_size == 5  # nothing loaded into it
    # An extra whose state is empty saves no entry; it is not refused.
    empty = {"state_dict": dict, "load_state_dict": lambda self, s: None}
    nothing = type("Nothing", (), empty)()
    CheckpointManager(tmp_path / "b").save(1, model=model, extra={"nothing": nothing})
    assert (
        CheckpointManager(tmp_path / "b").resume("auto", model=model, extra={"nothing": nothing})
        == 1
    )


def test_another_runs_optimizer_is_refused_with_the_scheduler_named_as_a_cause(tmp_path) -> None:
    """docs/checkpoints.md's train_extra.py pointed at train_ckpt.py's folder: the saved optimizer
    has no initial_lr (no lr scheduler there). The refusal used to ask only whether the optimizer
    had stepped; it names the scheduler and the other run as causes."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    CheckpointManager(tmp_path).save(1, model=model, optimizer=opt)
    again = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(again, step_size=5)  # adds initial_lr to the param groups
    with pytest.raises(ValueError, match=r"initial_lr.*lr scheduler.*another run") as exc:
        CheckpointManager(tmp_path).resume("auto", model=model, optimizer=again)
    assert "does not match the optimizer" in str(exc.value)
