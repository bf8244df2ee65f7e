"""Preemption in the launcher: the exception that ends a preempted worker, and the exit status.

The mechanism lives in the library (``dscale.checkpoint.PreemptionGuard``): on SIGTERM (or the
signals in ``checkpoint.save_on_signals``) every rank finishes its step, saves, and stops. Here
the worker turns that into exit status 75 (EX_TEMPFAIL), and the launcher exits with 75 too when
it was signalled or its workers stopped that way, so that ``deploy/slurm/dscale.sbatch`` requeues
the job and torchelastic restarts the workers; the next attempt resumes from that checkpoint.
"""

from __future__ import annotations

from dscale.checkpoint import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "failures_were_preemption"]


class Preempted(Exception):
    """Every rank saved ``step`` after a preemption signal; the worker exits with status 75."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted: saved a checkpoint at step {step}")
        self.step = step


def failures_were_preemption(exit_codes: list[int]) -> bool:
    """True when every failed worker exited with the preemption status."""
    return bool(exit_codes) and all(code == PREEMPTED_EXIT_CODE for code in exit_codes)
