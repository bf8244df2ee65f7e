"""After a worker failure, the rerun hint names an override the error quotes."""

from __future__ import annotations

import sys

import pytest

from launch import rerun

CAUSE = (
    "rank 0 failed: ValueError: args.optim='adamw_typo' is not an optimizer; use adamw or sgd\n"
    "  at /home/me/proj/train.py:12 in main\n"
    "  rank 1: lost its peer (a consequence)\n"
    "  rank 0's traceback: /tmp/runs/exp/torchelastic/attempt_0/0/error.json"
)
ARGV = [
    "/x/launch/__main__.py",
    "entrypoint=train:main",
    "args.optim=adamw_typo",
    "trainer.max_steps=300",
    "checkpoint.enabled=false",
    "hydra.run.dir=/tmp/runs/exp",
]


def test_the_hint_names_the_override_the_error_quotes_before_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ARGV)
    advice = rerun.resume_advice({"enabled": False}, failure=CAUSE)
    command = rerun.rerun_command()
    assert command in advice  # the command is still given, in full
    assert "the error quotes args.optim=adamw_typo from this command: correct it" in advice
    # Not the run folder (every failure names its paths), numbers, booleans or the entrypoint.
    assert rerun.overrides_named_in(CAUSE, ARGV[1:]) == ["args.optim=adamw_typo"]


def test_a_failure_that_quotes_no_override_keeps_the_plain_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ARGV)
    plain = "rank 0 failed: RuntimeError: CUDA out of memory\n  at /home/me/proj/train.py:40"
    advice = rerun.resume_advice({"enabled": False}, failure=plain)
    assert "the error quotes" not in advice
    assert advice == rerun.resume_advice({"enabled": False})
