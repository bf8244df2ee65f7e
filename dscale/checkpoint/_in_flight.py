"""An asynchronous save in flight: published when every rank is done, or at interpreter exit.

DCP's background write completes on each rank after the coordinator has written ``.metadata``,
which it does once every rank's data is written; then only the coordinator renames the folder.

* During training the ranks agree that every rank's part is done (one CPU all-reduce of one
  int per step, only while a save is in flight), so they publish, or fail to, at the same step
  and a failure raises the same CheckpointSaveError on every rank.
* A process that exits with a save in flight (``sys.exit(75)`` after a preemption save) still
  publishes it: when it leaves a PreemptionGuard after a preemption (before any
  ``destroy_process_group()`` outside it), and else at interpreter exit, where Python has
  joined DCP's writer thread before running ``atexit`` hooks. Each rank waits for its own part
  and the coordinator renames, without a collective.
"""

from __future__ import annotations

import atexit
import logging
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException

from dscale import _dist
from dscale.checkpoint import _publish
from dscale.checkpoint._errors import ERROR_TYPES, CheckpointSaveError, describe_failure

__all__ = ["InFlight", "publish_all_in_flight"]

logger = logging.getLogger(__name__)

# Saves in flight, by id. Strong references: after sys.exit the frame holding the manager
# is gone before atexit hooks run.
_IN_FLIGHT: dict[int, InFlight] = {}


@dataclass
class InFlight:
    """One asynchronous save: DCP's future, its temp folder and the name it is published as."""

    future: Future[Any]
    tmp: Path
    final: Path
    keep: int
    is_coordinator: bool

    def __post_init__(self) -> None:
        _IN_FLIGHT[id(self)] = self

    def done_everywhere(self, group: ProcessGroup | None) -> bool:
        """Whether every rank's part is written; collective over a CPU ``group``."""
        return not _dist.any_rank(not self.future.done(), group)

    def finish(self, group: ProcessGroup | None) -> None:
        """Wait, publish (coordinator), and raise CheckpointSaveError on every rank if any failed.

        Collective: every rank calls it at the same point.
        """
        _IN_FLIGHT.pop(id(self), None)
        problem: BaseException | None = None
        try:
            self.future.result()
        except CheckpointException as exc:
            problem = CheckpointSaveError(
                f"asynchronous save into {self.tmp} failed: {describe_failure(exc)}; the "
                "unfinished folder was removed and the previous checkpoints are untouched"
            )
        if problem is None and self.is_coordinator:
            try:
                self._publish()
            except OSError as exc:
                problem = CheckpointSaveError(
                    f"publishing the asynchronous save of {self.final} failed ({exc}); the "
                    "unfinished folder was removed and the previous checkpoints are untouched; "
                    f"check that {self.final.parent} is writable"
                )
        if problem is not None and self.is_coordinator:
            shutil.rmtree(self.tmp, ignore_errors=True)
        _dist.gather_then_raise(problem, group, f"publishing {self.final}", ERROR_TYPES)

    def finish_at_exit(self) -> None:
        """Publish on the way out, without collectives; a failure is logged, not raised."""
        _IN_FLIGHT.pop(id(self), None)
        try:
            self.future.result()
            if self.is_coordinator:
                self._publish()
                logger.warning("published %s on exit (the save was still in flight)", self.final)
        except (CheckpointException, OSError) as exc:
            logger.error("the save in flight at exit was not published (%s): %s", self.tmp, exc)

    def _publish(self) -> None:
        _publish.publish(self.tmp, self.final)
        _publish.purge(self.final.parent, self.keep)


def publish_all_in_flight() -> None:
    """Publish every save in flight in this process, without collectives.

    Each rank waits for its own part; the coordinator renames. For exits: PreemptionGuard
    calls it when it is left after a preemption, and it runs at interpreter exit.
    """
    for save in list(_IN_FLIGHT.values()):
        save.finish_at_exit()


atexit.register(publish_all_in_flight)
