"""SIGTERM from the launcher's first instant, before torch and Hydra have loaded.

Slurm sends SIGTERM to a job step whenever it is preempted or cancelled with ``--signal``, also
a moment after the step started. torchelastic installs its own handler only when it starts the
workers, seconds later; until then Python's default action ended ``dscale-launch`` with status
143, and the job ended FAILED instead of being requeued. ``install()`` is the first thing
``dscale-launch`` does: a SIGTERM before the workers start exits with status 75
(``dscale.checkpoint.PREEMPTED_EXIT_CODE``), so the job is restarted; no worker has trained yet,
so nothing is lost. Once the workers start, torchelastic's handler takes over and the workers
save a checkpoint first. This module imports nothing heavy, so the handler is in place within
milliseconds.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

# dscale.checkpoint.PREEMPTED_EXIT_CODE, which is not imported here: importing it loads torch.
PREEMPTED_EXIT_CODE = 75


def install() -> None:
    """Exit with status 75 on SIGTERM until torchelastic replaces this handler."""
    signal.signal(signal.SIGTERM, _stop_before_start)


def _stop_before_start(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    sys.stderr.write(
        f"dscale-launch: stopped by {name} before any worker started, so there was nothing to "
        f"save. Exiting with {PREEMPTED_EXIT_CODE} so that the job is restarted.\n"
    )
    # SystemExit, not os._exit: `finally` blocks still run (the file_sd targets are removed).
    raise SystemExit(PREEMPTED_EXIT_CODE)
