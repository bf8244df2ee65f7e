"""What to run after a stop: the same command, from the same folder, and where it resumes.

The default run folder is keyed by the job's name (``outputs/<hydra.job.name>``), not by the
time, so running the same command again finds its checkpoints and ``checkpoint.resume=auto``
continues from the newest one. A fresh start is explicit: a new name (``hydra.job.name=...``),
which is a new folder, checkpoints included.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dscale.checkpoint import CheckpointManager

__all__ = ["rerun_command", "resume_advice"]

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


def resume_advice(checkpoint: Mapping[str, Any]) -> str:
    """Two lines: the command that resumes (and from which step), and how to start fresh."""
    command = rerun_command()
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
