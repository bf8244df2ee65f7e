"""What to run after a stop: the same command, from the same folder, and where it resumes.

The default run folder is keyed by the job's name (``outputs/<hydra.job.name>``), not by the
time, so running the same command again finds its checkpoints and ``checkpoint.resume=auto``
continues from the newest one. A fresh start is explicit: a new name (``hydra.job.name=...``),
which is a new folder, checkpoints included. A command with other training settings in a folder
that holds checkpoints is refused, rather than silently continuing the earlier run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dscale.checkpoint import CheckpointManager
from launch.validate import ConfigError

__all__ = [
    "check_same_job",
    "discard_refused_run_dir",
    "nothing_to_train",
    "overrides_named_in",
    "rerun_command",
    "resume_advice",
    "world_size_change",
]

# What may change between the runs of one job: how long it runs, how it is launched, watched,
# checkpointed and faulted, and the wrapper (checkpoints reshard). The rest is the training.
_MAY_CHANGE = (
    "launcher.",
    "metrics.",
    "checkpoint.",
    "fault.",
    "parallel.",
    "trainer.max_steps",
    "trainer.log_every",
    "trainer.device",
)

FRESH_START = "hydra.job.name=<a new name> (a new run folder, with its own checkpoints)"


def rerun_command(argv: Sequence[str] | None = None, cwd: str | None = None) -> str:
    """``cd CWD && COMMAND`` that runs this launcher again with the same overrides.

    ``checkpoint.resume`` is set to ``auto`` if the command said otherwise.
    """
    argv = list(sys.argv if argv is None else argv)
    head = [sys.executable, "-m", "launch"] if Path(argv[0]).name == "__main__.py" else argv[:1]
    args = [a for a in argv[1:] if not a.lstrip("+~").startswith("checkpoint.resume=")]
    if len(args) != len(argv) - 1:
        args.append("checkpoint.resume=auto")
    return f"cd {shlex.quote(cwd or os.getcwd())} && {shlex.join(head + args)}"


def overrides_named_in(message: str, argv: Sequence[str] | None = None) -> list[str]:
    """The command's ``key=value`` overrides whose value the failure ``message`` quotes.

    A value the workers refused (a misspelt choice of a key the launcher does not know the
    choices of, such as your own ``args.*``) would be repeated by "run the same command again";
    these are the ones to correct first. Values of one or two characters, numbers and booleans
    are too common in messages to point at an override.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    named = []
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        value = value.strip("'\"")
        if not sep or key.startswith("hydra.") or len(value) < 3:
            continue  # hydra.*: the run folder, whose paths every failure message names
        if value.lower() in ("true", "false", "null", "none"):
            continue
        try:
            float(value)
            continue
        except ValueError:
            pass
        if re.search(rf"(?<![\w./-]){re.escape(value)}(?![\w/-])", message):
            named.append(f"{key}={value}")
    return named


def resume_advice(checkpoint: Mapping[str, Any], *, failure: str = "") -> str:
    """Two lines: the command that resumes (and from which step), and how to start fresh.

    ``failure``: what the workers raised; an override whose value it quotes is named first, so
    the command below is not rerun with the same mistake.
    """
    command = rerun_command()
    named = overrides_named_in(failure) if failure else []
    if named:
        command = (
            f"{command}\n  (the error quotes {', '.join(named)} from this command: "
            "correct it in the command first)"
        )
    if not checkpoint.get("enabled", False):
        return (
            "checkpoints are off (checkpoint.enabled=false), so running it again starts from "
            f"step 0:\n  {command}"
        )
    folder = Path(str(checkpoint["dir"])).expanduser().resolve()
    latest = CheckpointManager(folder).latest()
    where = (
        f"step {latest.name[len('step-') :]} ({latest})"
        if latest is not None
        else f"step 0 (no checkpoint in {folder} yet)"
    )
    return (
        f"to resume from {where}, run the same command again:\n  {command}\n"
        f"to start fresh instead, add {FRESH_START}"
    )


def discard_refused_run_dir(run_dir: Path) -> bool:
    """Remove the folder Hydra made for a command the launcher refused; True if it did.

    Hydra creates the run folder (``.hydra/`` and ``<job name>.log``) before the launcher sees
    the config, so a refused command would leave a folder that looks like a run. Only a folder
    holding nothing else is removed (with an ``outputs/`` above it left empty); an earlier run's
    folder, or any folder with other files, is kept as it is.
    """
    hydra_files = {".hydra", f"{run_dir.name}.log"}
    try:
        entries = {p.name for p in run_dir.iterdir()}
    except OSError:
        return False
    if not entries <= hydra_files | {p.name for p in run_dir.glob("*.log")}:
        return False
    for name in entries:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            for inner in path.iterdir():
                if inner.is_dir() and not inner.is_symlink():
                    return False  # not Hydra's three files: leave it
            for inner in path.iterdir():
                inner.unlink()
            path.rmdir()
        else:
            path.unlink()
    run_dir.rmdir()
    if run_dir.parent.name == "outputs":
        try:
            run_dir.parent.rmdir()  # only if empty
        except OSError:
            pass
    return True


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, Mapping):
        return {prefix[:-1]: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def check_same_job(run_dir: Path, config: Mapping[str, Any]) -> None:
    """Refuse to continue the run in ``run_dir`` with other training settings.

    ``config`` is this command's resolved config; the earlier run's is the
    ``config.resolved.yaml`` it left. Only when ``checkpoint.resume=auto`` would load one of
    its checkpoints. Keys in ``_MAY_CHANGE``, and keys only one of the two has, may differ.
    """
    previous_file = run_dir / "config.resolved.yaml"
    c = config["checkpoint"]
    if not (c["enabled"] and c["resume"] == "auto" and previous_file.is_file()):
        return
    latest = CheckpointManager(Path(c["dir"])).latest()
    if latest is None:
        return
    before = _flat(OmegaConf.to_container(OmegaConf.load(previous_file), resolve=True))
    now = _flat(config)
    changed = [
        f"{key}: {before[key]!r} -> {now[key]!r}"
        for key in sorted(before.keys() & now.keys())
        if not key.startswith(_MAY_CHANGE) and before[key] != now[key]
    ]
    # The user's own args: a key added or dropped is a changed setting too (schema keys that one
    # of the two versions lacks are not).
    changed += [
        f"{key}: {before.get(key, '(absent)')!r} -> {now.get(key, '(absent)')!r}"
        for key in sorted(before.keys() ^ now.keys())
        if key.startswith("args.")
    ]
    if changed:
        raise ConfigError(
            f"{run_dir} holds an earlier run of this job (its newest checkpoint is {latest}) "
            f"with other settings: {'; '.join(changed[:5])}. checkpoint.resume=auto would "
            "continue that run with these. To start a new run with them, add "
            "hydra.job.name=NEW_NAME (a new folder); to continue that run, run it with its "
            "own settings"
        )


def nothing_to_train(config: Mapping[str, Any]) -> str | None:
    """One line when the checkpoint ``checkpoint.resume=auto`` would load is at or past
    ``trainer.max_steps``, else None.

    Such a run would train nothing, then publish a ``step-<max_steps>`` checkpoint holding the
    later state and overwrite the earlier run's summary; the launcher says so and stops instead.
    """
    c = config["checkpoint"]
    if not (c["enabled"] and c["resume"] == "auto"):
        return None
    latest = CheckpointManager(Path(c["dir"])).latest()
    if latest is None:
        return None
    step, max_steps = int(latest.name[len("step-") :]), int(config["trainer"]["max_steps"])
    if step < max_steps:
        return None
    where = "at" if step == max_steps else "past"
    return (
        f"dscale-launch: the run is complete: step {step} ({latest}) is already {where} "
        f"trainer.max_steps={max_steps}: nothing to train; nothing was written (the run folder "
        "is as it was); to train further raise trainer.max_steps, to train a new run add "
        "hydra.job.name=<name>"
    )


def world_size_change(config: Mapping[str, Any], world_size: int) -> str | None:
    """What changes when the run resumes on ``world_size`` ranks from a checkpoint saved on
    another number, or None.

    The checkpoint reshards, but the global batch is each rank's batch times the ranks, and each
    rank's random streams start again from the seed; say so, and how to keep the batch. The
    saved world size is the checkpoint's own record (``dscale.json`` in ``step-N/``).
    """
    c = config["checkpoint"]
    if not (c["enabled"] and c["resume"] == "auto"):
        return None
    latest = CheckpointManager(Path(c["dir"])).latest()
    try:
        was = int(json.loads((latest / "dscale.json").read_text())["world_size"]) if latest else 0
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = world_size
    if not was or was == now:
        return None
    batch = config.get("data", {}).get("batch_size")
    if isinstance(batch, int):
        sizes = f"from {was * batch} to {now * batch} samples per step (data.batch_size={batch})"
        keep = (
            f"data.batch_size={was * batch // now} on {now} ranks, or {was} ranks"
            if (was * batch) % now == 0
            else f"{was} ranks"
        )
    else:
        sizes = f"from {was} to {now} times each rank's batch"
        keep = f"{was} ranks, or each rank's batch scaled by {was}/{now}"
    return (
        f"resuming {latest} (saved on {was} ranks) on {now} ranks: the global batch changes "
        f"{sizes}, and each rank's random streams start again from trainer.seed (RNG states are "
        f"per rank). To keep the global batch, use {keep}"
    )
