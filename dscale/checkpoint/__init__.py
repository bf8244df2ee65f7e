"""Sharded checkpoints of model, optimizer, scaler, step and RNG states, with DCP.

API (all ranks call every function at the same point)::

    from dscale.checkpoint import CheckpointManager

    ckpt = CheckpointManager(directory, every=50, keep=2, async_save=False, process_group=None)
    start = ckpt.resume("auto", model=model, optimizer=opt, scaler=scaler) or 0
    # resume: "auto" (newest complete checkpoint), a step-N folder path, or None / "" (fresh)
    # also: ckpt.load_latest(...) -> int | None, ckpt.load(path, ...) -> int, ckpt.latest(),
    # ckpt.check_room(model=...) (resume() runs it when every > 0), check_directory(path)
    for step in range(start, max_steps):
        train_one_iteration()
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, scaler=scaler)  # step N = N done
    ckpt.save(max_steps, model=model, optimizer=opt, scaler=scaler)  # no-op if just saved
    ckpt.wait()  # publishes a pending async save (one still in flight at exit is published then)

    load_checkpoint(path, model=..., optimizer=..., scaler=..., process_group=None) -> step
    load_scaler_file(scaler, "scaler.pt")  # a torch.save(torch_scaler.state_dict(), ...) file

What goes in: ``model`` (plain, DDP, FSDP1, FSDP2; stored without wrapper prefixes, so it
reshards and moves between wrappers), ``optimizer`` (a torch optimizer, stored by parameter
name, or any object with state_dict()/load_state_dict() such as dscale.FP16Optimizer, whose
state must already have its saved structure when loading), ``scaler`` (dscale.GradScaler or
torch.amp.GradScaler), ``extra`` (a dict of more Statefuls), the step, and per-rank RNG states
(torch CPU, CUDA when in use, Python's ``random``; restored only at the same world size). The
scaler's dscale.fp8 companions (WeightScales, Float8Numerics, Float8Fallback) and its
dscale.precision.PrecisionSchedule come with it, under ``fp8_weight_scales``, ``fp8_numerics``,
``fp8_fallback`` and ``precision_schedule``, without being named in ``extra``;
a checkpoint that lacks one's state is refused on load, and so is a checkpoint holding a
``precision_schedule`` loaded with a scaler that has none (load without ``scaler=`` for the
weights).

Preemption: ``with PreemptionGuard(["SIGTERM"]) as p: ... if p.should_stop(): save; exit(75)``;
all ranks agree on the step (one small CPU all-reduce per call).

On disk: ``directory/step-N/`` with DCP's ``.metadata``, ``__<rank>_<n>.distcp``, ``dscale.json``
(format and version) and ``checksums.crc32`` (``<crc32>  <name>`` lines; each rank sums the
files it writes). A save writes ``.step-N.tmp`` and is renamed only after every rank has written,
so a crash leaves the previous checkpoints intact; a failed save removes its folder.

Before DCP opens a file, every entry of the folder must be a regular file (or a symlink to one
inside it) and every size ``.metadata`` declares must fit in the bytes on disk (holes only inside
tensor data) and be the shape of what it loads into; a folder that is refused raises
CorruptCheckpointError. Loading never runs code from the checkpoint's bytes
(exact-name metadata unpickler, ``weights_only=True`` values), reads into empty copies, and
changes nothing until every check (checksums, format, keys and shapes, scaler rows, the
scaler's validation) has passed on every rank; a failure on any rank raises the same error on
all of them.

Errors: CheckpointError (ValueError; names the folder or file), CorruptCheckpointError (a
checksum failed; ``resume="auto"`` skips to the previous checkpoint with a warning),
ScaleMismatchError (RuntimeError; raised on every rank, names the ranks and values) and
CheckpointSaveError (RuntimeError; a save failed, says the space needed and free).
"""

from dscale.checkpoint._errors import (
    CheckpointError,
    CheckpointSaveError,
    CorruptCheckpointError,
    ScaleMismatchError,
)
from dscale.checkpoint._load import load_checkpoint
from dscale.checkpoint._manager import CheckpointManager
from dscale.checkpoint._preemption import PREEMPTED_EXIT_CODE, PreemptionGuard
from dscale.checkpoint._safe_io import load_scaler_file

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "PreemptionGuard",
    "ScaleMismatchError",
    "load_checkpoint",
    "load_scaler_file",
]
