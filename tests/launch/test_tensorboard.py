"""metrics.tensorboard=true: scalars TensorBoard itself reads back; a refusal leaves no folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
import torch
from launch_helpers import ROOT, launch, output

import dscale
from launch.integrations import start_metrics
from launch.progress import Progress


def test_the_launchers_scalars_read_back_with_tensorboards_own_event_reader(tmp_path) -> None:
    """The oracle is what the progress served at each report, read back from the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = torch.nn.Linear(4, 1)
    scaler = dscale.GradScaler("cpu", init_scale=8.0)
    progress = Progress(30, 10, scaler, record=None)  # type: ignore[arg-type]
    cfg = {"enabled": True, "addr": "127.0.0.1", "port": 0, "linger_s": 0.0,
           "check_agreement_every": 0, "targets_dir": None, "tensorboard": True}  # fmt: skip
    served: dict[int, dict[str, float]] = {}
    with start_metrics(cfg, scaler, model, run_dir=tmp_path, rank=0, local_rank=0, log_every=10,
                       progress=progress):  # fmt: skip
        for step, loss in ((9, 2.5), (19, 1.25), (29, 0.625)):
            progress.update(step, loss, tokens=64)
            served[step] = progress.figures.values()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert sorted(tags) == sorted(k.removeprefix("dscale_") for k in served[29]), tags
    for tag in tags:
        back = {e.step: e.value for e in events.Scalars(tag)}
        want = {s: float(torch.tensor(v[f"dscale_{tag}"], dtype=torch.float32)) for s, v in
                served.items() if f"dscale_{tag}" in v}  # fmt: skip
        assert back == want, tag
    assert {e.step: e.value for e in events.Scalars("train_loss")} == {9: 2.5, 19: 1.25, 29: 0.625}


def test_tensorboard_is_in_a_documented_extra_that_make_test_installs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["tensorboard"] == ["tensorboard==2.21.0"]
    assert ",tensorboard]" in (ROOT / "Makefile").read_text()
    assert "'.[tensorboard]'" in (ROOT / "docs" / "metrics.md").read_text()


def test_a_refused_command_leaves_no_run_folder(tmp_path) -> None:
    """metrics.tensorboard=true where TensorBoard is missing: exit 2, and no outputs/<name>."""
    blocked = tmp_path / "no_tensorboard"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    run_dir = tmp_path / "outputs" / "tb"
    proc = launch(run_dir, "metrics.tensorboard=true", env={"PYTHONPATH": str(blocked)})
    assert proc.returncode == 2, output(proc)
    assert "pip install -e '.[tensorboard]'" in proc.stderr, output(proc)
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


def test_a_refusal_keeps_an_earlier_runs_folder(tmp_path: Path) -> None:
    """Only what Hydra made for the refused command goes; an earlier run's files stay."""
    from launch.rerun import discard_refused_run_dir

    run_dir = tmp_path / "outputs" / "exp"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("a: 1\n")
    (run_dir / "exp.log").write_text("")
    (run_dir / "config.resolved.yaml").write_text("trainer: {}\n")
    assert not discard_refused_run_dir(run_dir)
    assert (run_dir / "config.resolved.yaml").is_file() and (run_dir / ".hydra").is_dir()
    (run_dir / "config.resolved.yaml").unlink()
    assert discard_refused_run_dir(run_dir)
    assert not (tmp_path / "outputs").exists()


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
