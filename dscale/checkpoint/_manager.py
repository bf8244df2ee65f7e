"""CheckpointManager: when to save, where, how many to keep, and what to resume from."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed import ProcessGroup

from dscale import _dist
from dscale.checkpoint import _publish, _save
from dscale.checkpoint._errors import ERROR_TYPES, CheckpointSaveError, CorruptCheckpointError
from dscale.checkpoint._in_flight import InFlight
from dscale.checkpoint._layout import check_folder, list_complete, step_dir, temp_dir
from dscale.checkpoint._load import load_checkpoint
from dscale.checkpoint._states import build_states

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)

_NO_RESUME = ("", "none", "never")


def _uses_fsdp1(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class CheckpointManager:
    """Saves every ``every`` steps into ``directory/step-N``, keeps ``keep``, resumes.

    All ranks call every method at the same point (they run collectives). "Step N" is the
    state after N optimizer iterations: call ``maybe_save(N, ...)`` after the N-th, and a
    run resumed from ``step-N`` continues with iteration index N.

    Example::

        ckpt = CheckpointManager("ckpt", every=50, keep=2)
        start = ckpt.resume("auto", model=model, optimizer=opt, scaler=scaler) or 0
        for step in range(start, max_steps):
            train_one_step()
            ckpt.maybe_save(step + 1, model=model, optimizer=opt, scaler=scaler)
        ckpt.save(max_steps, model=model, optimizer=opt, scaler=scaler)
        ckpt.wait()
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        every: int = 0,
        keep: int = 2,
        async_save: bool = False,
        process_group: ProcessGroup | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(
                f"every must be an int >= 0, got {every!r}; it is the number of "
                "steps between saves (0 saves only when save() is called)"
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"keep must be an int >= 1, got {keep!r}; it is how many "
                "published checkpoints to keep (2 is a safe choice)"
            )
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.async_save = async_save
        self.process_group = process_group
        self.is_coordinator = _dist.rank(process_group) == 0
        self._async_group: ProcessGroup | None = None
        self._agree_group: ProcessGroup | None = None
        self._pending: InFlight | None = None  # the same on every rank
        self._last_step: int | None = None
        self._async_since_wait = False

    def maybe_save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save if ``step`` is a positive multiple of ``every``; return whether it saved.

        Also publishes a finished asynchronous save. Takes the keyword arguments of save().
        """
        self._publish_if_done()
        if self.every and step > 0 and step % self.every == 0:
            self.save(step, model=model, optimizer=optimizer, scaler=scaler, extra=extra)
            return True
        return False

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Save the state after ``step`` iterations as ``step-N``; skip if already saved or loaded.

        Args:
            step: how many optimizer iterations are done (the folder is ``step-N``).
            model: the model (plain, DDP, FSDP1 or FSDP2), stored without wrapper prefixes.
            optimizer: a torch optimizer (stored by parameter name; needs ``model``) or any
                object with ``state_dict()`` / ``load_state_dict()``, e.g. dscale.FP16Optimizer.
            scaler: a dscale.GradScaler, dscale.StepGuard or torch.amp.GradScaler.
            extra: more state, ``{name: object with state_dict() and load_state_dict()}`` (a
                data loader's position, dscale.fp8's weight scales); a resume must pass the same
                names.

        Synchronous saves are published (renamed, checksummed, old ones purged) before this
        returns on any rank. Asynchronous saves return after staging a copy of the state; they
        are published by a later maybe_save(), save() or wait().
        """
        if step == self._last_step:
            logger.debug("step %d is already saved or was loaded; not saving it again", step)
            return
        states = build_states(
            step=step,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            extra=extra,
            group=self.process_group,
        )  # validates arguments
        self._finish_pending()
        root, group = self.directory, self.process_group
        tmp, final = temp_dir(root, step), step_dir(root, step)
        problem = _save.prepare_folder(root, self.is_coordinator)
        _save.raise_if_failed(problem, states, root=root, tmp=tmp, step=step, group=group)
        use_async = self.async_save and not _uses_fsdp1(model)
        if self.async_save and not use_async:
            # dcp.async_save cannot stage FSDP1's ShardedTensor (data_ptr not supported).
            logger.info("saving step %d synchronously: async save does not support FSDP1", step)
        future, problem = _save.write(
            states,
            tmp,
            step=step,
            group=group,
            async_group=self._cpu_group() if use_async else None,
            use_async=use_async,
        )
        if use_async:
            _save.raise_if_failed(problem, states, root=root, tmp=tmp, step=step, group=group)
            self._pending = InFlight(
                cast("Future[Any]", future), tmp, final, self.keep, self.is_coordinator
            )
            self._async_since_wait = True
            self._last_step = step
            return
        _save.raise_if_failed(problem, states, root=root, tmp=tmp, step=step, group=group)
        self._last_step = step
        problem = None
        if self.is_coordinator:
            try:
                _publish.publish(tmp, final)
                _publish.purge(root, self.keep)
            except OSError as exc:
                problem = exc
        # Every rank learns whether the rename happened, and raises with rank 0 if not.
        _dist.gather_then_raise(problem, group, f"publishing {final}", ERROR_TYPES)

    def wait(self) -> None:
        """Finish and publish a pending asynchronous save; every rank returns after it.

        Without asynchronous saves this does nothing: synchronous ones are published already.
        """
        self._finish_pending()
        if self._async_since_wait:
            self._async_since_wait = False
            _dist.barrier(self.process_group)

    def latest(self) -> Path | None:
        """The newest published checkpoint folder (checksums not yet verified), or None."""
        found = list_complete(self.directory)
        return found[0][1] if found else None

    def load(
        self,
        path: str | Path,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> int:
        """Load ``path`` (a ``step-N`` folder) in place and return N.

        Takes model=, optimizer=, scaler=, extra= as save() does; see load_checkpoint().
        """
        step = load_checkpoint(
            path,
            process_group=self.process_group,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            extra=extra,
        )
        self._last_step = step
        return step

    def load_latest(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> int | None:
        """Load the newest published checkpoint whose checksums hold; None if there is none.

        Rank 0 lists the folder and every rank tries the same checkpoints in the same order, so
        a rank that sees another listing (a lagging network filesystem) cannot pick another
        one. A corrupt checkpoint is reported with a warning naming the file, and the previous
        one is tried (on every rank together). Any other error is raised on every rank.
        """
        listing = [(step, str(path)) for step, path in list_complete(self.directory)]
        candidates = _dist.broadcast_object(listing, self.process_group)
        for step, path in candidates:
            try:
                return self.load(path, model=model, optimizer=optimizer, scaler=scaler, extra=extra)
            except CorruptCheckpointError as exc:
                logger.warning(
                    "skipping checkpoint step %d: %s; trying the previous one", step, exc
                )
        logger.info("no checkpoint to resume from in %s", self.directory)
        return None

    def resume(
        self,
        resume: str | Path | None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> int | None:
        """Resume as ``checkpoint.resume`` says: "auto", a folder path, or None/"" for no resume.

        ``model``, ``optimizer``, ``scaler`` and ``extra`` are save()'s, loaded in place; pass
        the same ones (and the same ``extra`` names) the checkpoint was saved with.

        Returns the step to continue from, or None when nothing was loaded. A manager that
        saves periodically (``every > 0``) first checks that the folder can take a checkpoint
        (see check_room), so that one that cannot fails before any training, not at the first
        save; with ``every=0`` (a read-only folder may be loaded from) call check_room yourself.
        """
        target = self.check_resume(resume)
        if self.every:
            self.check_room(model=model, optimizer=optimizer, scaler=scaler, extra=extra)
        if target is None:
            return None
        if target == "auto":
            return self.load_latest(model=model, optimizer=optimizer, scaler=scaler, extra=extra)
        return self.load(target, model=model, optimizer=optimizer, scaler=scaler, extra=extra)

    def check_room(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Raise CheckpointSaveError on every rank unless the folder has room for ``keep``.

        The coordinator creates the folder, writes and removes a small file there, and compares
        the free space (where the filesystem reports it) with the tensor bytes of these states
        on all ranks, times the checkpoints ``keep`` holds at the peak of a save (``keep`` + 1,
        less those already there). resume() calls it; call it yourself before training if you
        do not resume. A torch optimizer's state counts once it exists (after the first step).
        """
        if isinstance(optimizer, torch.optim.Optimizer) and not optimizer.state:
            # DCP would make its state by a zero-lr step(), changing a fresh run (Adam's step).
            optimizer = None
        built = build_states(
            step=0,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            extra=extra,
            group=self.process_group,
        )
        needed = sum(_dist.all_gather_objects(_save.local_bytes(built), self.process_group))
        problem = None
        if self.is_coordinator:
            # keep=K holds K checkpoints, and a save writes the next one before the oldest is
            # removed: K + 1 at the peak, less those already on disk (not in the free space).
            copies = max(1, self.keep + 1 - len(list_complete(self.directory)))
            what = (
                "one checkpoint needs"
                if copies == 1
                else f"{copies} checkpoints (keep={self.keep}, and the next one is written "
                f"before the oldest is removed) need {copies} x {_save.format_bytes(needed)} ="
            )
            problem = _save.check_directory(self.directory, needed * copies, what=what)
        problem = _dist.broadcast_object(problem, self.process_group)
        if problem is not None:
            raise CheckpointSaveError(problem)

    @staticmethod
    def check_directory(directory: str | Path) -> None:
        """Raise CheckpointSaveError unless ``directory`` can be created and written here.

        Launchers call it before starting any rank; it creates the folder.
        """
        problem = _save.check_directory(Path(directory))
        if problem is not None:
            raise CheckpointSaveError(problem)

    @staticmethod
    def check_resume(resume: str | Path | None) -> str | Path | None:
        """What resume() would do with ``resume``, checked without reading a checkpoint.

        Returns None (fresh start), "auto", or the folder; raises CheckpointError for a path
        that is not a folder. Launchers call it before starting any rank.
        """
        if resume is None or resume in _NO_RESUME:
            return None
        if resume == "auto":
            return "auto"
        path = Path(resume)
        check_folder(path)
        return path

    def _cpu_group(self) -> ProcessGroup | None:
        """A dedicated gloo group for background saves (made on first use, by every rank).

        dcp.async_save needs a CPU backend, and its collectives run in a background thread.
        """
        if self._async_group is None:
            self._async_group = _dist.new_gloo_group(self.process_group)
            # The main thread's agreement on "every rank's save is done" (CPU, one int).
            self._agree_group = _dist.cpu_group(self.process_group)
        return self._async_group

    def _publish_if_done(self) -> None:
        """Publish a finished asynchronous save once every rank's part is done (agreed)."""
        if self._pending is not None and self._pending.done_everywhere(self._agree_group):
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait for the save in flight and publish it; collective (every rank calls it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish(self.process_group)
