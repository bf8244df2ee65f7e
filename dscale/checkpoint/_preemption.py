"""Turn a scheduler's termination signal into "finish this step, save on every rank, stop".

Slurm (``--signal``, ``scancel``), Kubernetes (pod termination) and spot instances send SIGTERM
(or a chosen signal) some time before they kill. The handler only records the signal; the
training loop asks :meth:`PreemptionGuard.should_stop` once per step, and the ranks agree with
one small CPU all-reduce, so all of them stop after the same step even when only some received
the signal. Repeated signals while the job saves are logged and ignored: the save goes on, and a
hard kill after the grace period still leaves the previous checkpoint loadable (saves are
published by an atomic rename). Leaving the guard after a preemption publishes an asynchronous
save still in flight (each rank waits for its part; no collective), so ``sys.exit(75)`` right
after ``ckpt.save(...)`` loses nothing.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

from torch.distributed import ProcessGroup

from dscale import _dist
from dscale.checkpoint._in_flight import publish_all_in_flight

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionGuard"]

logger = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". The Slurm script requeues on it,
# and torchelastic restarts workers that exit with any non-zero status.
PREEMPTED_EXIT_CODE = 75


def _signal_number(sig: int | str) -> signal.Signals:
    try:
        if isinstance(sig, str):
            name = sig.upper()
            return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        return signal.Signals(sig)
    except (KeyError, ValueError):
        raise ValueError(
            f"signals has {sig!r}, which is not a signal; use a name such as 'SIGTERM' or "
            "'SIGUSR1', or its number"
        ) from None


class PreemptionGuard:
    """Records termination signals; ``should_stop()`` tells every rank to save and stop together.

    Use it as a context manager around the training loop, on every rank (entering it may create
    a gloo group, which is a collective)::

        with PreemptionGuard(["SIGTERM"]) as preemption:
            for step in range(start, max_steps):
                train_one_step()
                if preemption.should_stop():
                    ckpt.save(step + 1, model=model, optimizer=opt, scaler=scaler)
                    sys.exit(PREEMPTED_EXIT_CODE)  # a restart resumes from step + 1
                ckpt.maybe_save(step + 1, model=model, optimizer=opt, scaler=scaler)

    Args:
        signals: signal names or numbers to handle (SIGKILL cannot be handled).
        process_group: the ranks that must stop together (None: the default group).
    """

    def __init__(
        self,
        signals: Iterable[int | str] = ("SIGTERM",),
        *,
        process_group: ProcessGroup | None = None,
    ) -> None:
        self.signals = tuple(dict.fromkeys(_signal_number(s) for s in signals))
        if signal.SIGKILL in self.signals or signal.SIGSTOP in self.signals:
            raise ValueError(f"signals has {self.signals}; SIGKILL and SIGSTOP cannot be handled")
        self.process_group = process_group
        self.received: signal.Signals | None = None
        self.num_received = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._group: ProcessGroup | None = None
        self._stopping = False

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionGuard must be entered in the main thread: Python runs signal "
                "handlers there only"
            )
        self._group = _dist.cpu_group(self.process_group)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._stopping:
            # Leaving after a preemption (sys.exit(75) inside the block): an asynchronous save
            # started for it must be on disk before the process (or its process group) goes.
            publish_all_in_flight()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only record here: the loop acts at the next step boundary, outside the handler.
        self.num_received += 1
        if self.received is None:
            self.received = signal.Signals(signum)

    def should_stop(self) -> bool:
        """True on every rank once any rank has received a signal; call once per step.

        Every rank must call it at the same point (it all-reduces one integer on the CPU).
        """
        stop = _dist.any_rank(self.received is not None, self._group)
        if stop and not self._stopping:
            self._stopping = True
            here = self.received.name if self.received is not None else "no signal on this rank"
            logger.warning("preemption: stopping after this step to save a checkpoint (%s)", here)
        return stop
