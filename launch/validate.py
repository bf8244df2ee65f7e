"""Fail before any worker starts: impossible values and busy ports, each named with its fix.

Unknown keys, wrong types and choices are rejected earlier, by Hydra against
``launch/schema.py``. Checks that belong to the library are not written twice: ``GradScaler`` and
``CheckpointManager`` are built here once (on the CPU, writing nothing) and their own messages
are passed on, prefixed with the config key.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import importlib.util
import inspect
import os
import re
import socket
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.run import parse_min_max_nnodes

from dscale import GradScaler
from dscale.checkpoint import CheckpointManager, CheckpointSaveError, PreemptionGuard
from launch.applies import unused_keys
from launch.choices import bad_choice
from launch.entrypoint import EntrypointError, load_entrypoint
from launch.mesh import MESH_STRATEGIES, MeshError, check_batches, check_model, mesh_shape
from launch.schema import DEMO_ENTRYPOINT, Device, JobConfig


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def resolve_nproc(value: str, strategy: str) -> int:
    """torchrun's ``--nproc-per-node`` values; ``auto`` without a GPU means 2 (1 for single)."""
    if value.isdigit() and int(value) > 0:
        return int(value)
    if value == "auto":
        if torch.cuda.is_available():
            return torch.cuda.device_count()
        return 1 if strategy == "single" else 2
    if value == "cpu":
        return len(os.sched_getaffinity(0))
    if value == "gpu":
        _need(
            torch.cuda.is_available(),
            "launcher.nproc_per_node=gpu but CUDA is not available; use a number or auto",
        )
        return torch.cuda.device_count()
    raise ConfigError(
        f"launcher.nproc_per_node={value!r} is not a process count; use a positive integer, "
        "auto, cpu or gpu"
    )


def _launcher(job: JobConfig) -> int:
    lc = job.launcher
    try:
        lo, hi = parse_min_max_nnodes(lc.nnodes)
    except (ValueError, RuntimeError):
        lo = hi = -1
    _need(
        0 < lo <= hi,
        f"launcher.nnodes={lc.nnodes!r} is not N or MIN:MAX with 0 < MIN <= MAX; e.g. "
        "launcher.nnodes=2 or launcher.nnodes=1:4",
    )
    _need(
        lc.rdzv_backend in ("static", "c10d", "etcd", "etcd-v2"),
        f"launcher.rdzv_backend={lc.rdzv_backend!r} is not a rendezvous backend; use c10d "
        "(or static, torchrun's default)",
    )
    _need(
        lc.max_restarts >= 0,
        f"launcher.max_restarts={lc.max_restarts} must be >= 0 (0, torchrun's default, "
        "means no restart)",
    )
    _need(lc.pg_timeout_s > 0, f"launcher.pg_timeout_s={lc.pg_timeout_s} must be > 0 seconds")
    _need(
        hi == 1 or lc.rdzv_backend == "static" or bool(lc.rdzv_endpoint),
        f"launcher.nnodes={lc.nnodes} with launcher.rdzv_backend={lc.rdzv_backend} needs "
        "launcher.rdzv_endpoint=HOST:PORT on the first node (every node passes the same one)",
    )
    nproc = resolve_nproc(str(lc.nproc_per_node), job.parallel.strategy)
    if job.parallel.strategy == "single":
        _need(
            nproc == 1 and hi == 1,
            f"parallel=single runs one process, got launcher.nproc_per_node={nproc} and "
            f"launcher.nnodes={lc.nnodes}; use parallel=ddp or launcher.nproc_per_node=1",
        )
    return nproc


def _trainer(job: JobConfig) -> None:
    t = job.trainer
    _need(t.max_steps >= 1, f"trainer.max_steps={t.max_steps} must be >= 1")
    _need(t.log_every >= 1, f"trainer.log_every={t.log_every} must be >= 1")
    _need(t.lr > 0, f"trainer.lr={t.lr} must be > 0")
    _need(
        t.device != Device.cuda or torch.cuda.is_available(),
        "trainer.device=cuda but CUDA is not available; use trainer.device=auto or cpu",
    )


def _library_check(node: str, kwargs: dict[str, Any], build: Callable[..., object]) -> None:
    """Build the library's object once, here, so a bad value fails with the library's message.

    The message is prefixed with the config key it names, e.g. ``scaler.backoff_factor: ...``.
    """
    try:
        build(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        # The library's message starts with the argument it rejects; find that one.
        found = [(m.start(), k) for k in kwargs if (m := re.search(rf"\b{k}\b", message))]
        key = min(found)[1] if found else "*"
        raise ConfigError(f"{node}.{key}: {message}") from exc


def _scaler(job: JobConfig) -> None:
    _library_check("scaler", dataclasses.asdict(job.scaler), partial(GradScaler, "cpu"))


def _model_and_data(job: JobConfig) -> None:
    m, d = job.model, job.data
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "hidden"):
        value = getattr(m, key, 1)
        _need(value >= 1, f"model.{key}={value} must be >= 1")
    if m.name == "gpt_small":
        _need(
            m.d_model % m.n_heads == 0,
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
            "change one of them",
        )
    _need(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    _need(d.batch_size >= 1, f"data.batch_size={d.batch_size} must be >= 1")
    if d.name == "synthetic":
        _need(0 <= d.noise <= 1, f"data.noise={d.noise} must be in [0, 1]")
    if d.name == "text":
        path = Path(d.path).expanduser().resolve()
        _need(path.is_file(), f"data.path={d.path!r} is not a file; point data.path at a text file")
        d.path = str(path)  # workers may run elsewhere: pass an absolute path
        _need(
            m.vocab_size >= 256,
            f"data=text needs model.vocab_size >= 256 (bytes), got {m.vocab_size}",
        )


def _port_free(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        # The exporter's server sets SO_REUSEADDR too, so a port in TIME_WAIT is not "taken".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise ConfigError(f"metrics.addr={addr!r} cannot be bound: {exc}") from exc
    return True


def _metrics(job: JobConfig, nproc: int) -> None:
    m = job.metrics
    if not m.enabled:
        return
    last = m.port + nproc - 1
    _need(
        m.port >= 1 and last <= 65535,
        f"metrics.port={m.port} needs ports {m.port}-{last} for {nproc} local ranks; "
        "pick a base port between 1024 and 65000",
    )
    _need(m.linger_s >= 0, f"metrics.linger_s={m.linger_s} must be >= 0")
    _need(
        not m.tensorboard or importlib.util.find_spec("tensorboard") is not None,
        "metrics.tensorboard=true needs TensorBoard, which is not installed here: pip install "
        "-e '.[tensorboard]' (in a clone; pip install 'dscale[tensorboard]' otherwise), or "
        "metrics.tensorboard=false",
    )
    _need(
        m.check_agreement_every >= 0,
        f"metrics.check_agreement_every={m.check_agreement_every} must be >= 0 (steps between "
        "cross-rank scale checks; 0 turns them off)",
    )
    busy = [p for p in range(m.port, last + 1) if not _port_free(m.addr, p)]
    _need(
        not busy,
        f"metrics.port={m.port}: port {busy[0] if busy else ''} is in use on {m.addr} (needed "
        f"{m.port}-{last} for {nproc} local ranks); pick another with metrics.port=... or turn "
        "metrics off with metrics.enabled=false",
    )


def _checkpoint(job: JobConfig) -> None:
    c = job.checkpoint
    if not c.enabled:
        return
    c.dir = str(Path(c.dir).expanduser().resolve())
    kwargs = {"directory": c.dir, "every": c.every, "keep": c.keep}
    _library_check("checkpoint", kwargs, CheckpointManager)  # creates nothing on disk
    try:
        target = CheckpointManager.check_resume(c.resume)
    except ValueError as exc:
        raise ConfigError(
            f"checkpoint.resume={c.resume!r}: {exc}; or checkpoint.resume=none for a fresh start"
        ) from exc
    if isinstance(target, Path):
        c.resume = str(target.expanduser().resolve())  # workers may start elsewhere
    latest = CheckpointManager(c.dir).latest()
    # A complete run (launch/rerun.py's nothing_to_train) writes nothing, so it is not probed:
    # the probe's file would change the folder.
    complete = target == "auto" and latest is not None and _step(latest) >= job.trainer.max_steps
    try:
        if not complete:
            CheckpointManager.check_directory(c.dir)  # creates the folder, like the first save
    except CheckpointSaveError as exc:
        raise ConfigError(
            f"checkpoint.dir={c.dir}: {exc}; choose it with checkpoint.dir=PATH"
        ) from None
    _need(
        target is not None or latest is None,
        f"checkpoint.resume={c.resume!r} starts fresh, but checkpoint.dir={c.dir} already holds "
        f"{latest.name if latest else ''} from an earlier run, and a fresh run there would mix "
        "its checkpoints with those. To start fresh, use a new folder: hydra.job.name=NEW_NAME "
        "(a new run folder) or checkpoint.dir=EMPTY_FOLDER; to continue that run, use "
        "checkpoint.resume=auto",
    )

    try:
        PreemptionGuard(c.save_on_signals)  # the library's own check; installs nothing
    except ValueError as exc:
        raise ConfigError(f"checkpoint.save_on_signals={c.save_on_signals}: {exc}") from None


def _step(checkpoint: Path) -> int:
    """N of a published ``step-N`` folder."""
    return int(checkpoint.name[len("step-") :])


def _entry(job: JobConfig) -> None:
    """What runs on every rank: a script that exists, or a ``module:function`` entrypoint."""
    if job.script is None:
        try:
            # Imported here too, so that a typo fails before any worker starts.
            load_entrypoint(job.entrypoint)
        except EntrypointError as exc:
            raise ConfigError(str(exc)) from None
        return
    _need(
        job.entrypoint == DEMO_ENTRYPOINT,
        f"script={job.script!r} and entrypoint={job.entrypoint!r} both given; a job runs one "
        "of them: drop one",
    )
    path = Path(job.script).expanduser().resolve()
    _need(
        path.is_file(),
        f"script={job.script!r} does not exist (looked for {path}); give the path of a Python "
        "file, relative to the folder you launch from",
    )
    try:  # a script that cannot even be compiled fails here, not on every rank
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError) as exc:
        raise ConfigError(
            f"script={job.script!r} cannot be compiled: {type(exc).__name__}: {exc}"
        ) from None
    job.script = str(path)  # the agent may start workers elsewhere


def _fault(job: JobConfig, world_size: int) -> None:
    f = job.fault
    if f.inf_steps:
        _need(
            0 <= f.inf_rank < world_size,
            f"fault.inf_rank={f.inf_rank} is not a rank of this {world_size}-rank job",
        )
        _need(
            job.scaler.enabled,
            "fault.inf_steps needs the step guard: scaler.enabled=true (every precision has "
            "one: a GradScaler for fp16, a StepGuard for bf16 and fp32)",
        )
        _steps_in_run("fault.inf_steps", f.inf_steps, job.trainer.max_steps)
    if f.spike_steps:
        _need(
            0 <= f.spike_rank < world_size,
            f"fault.spike_rank={f.spike_rank} is not a rank of this {world_size}-rank job",
        )
        _steps_in_run("fault.spike_steps", f.spike_steps, job.trainer.max_steps)
    if f.kill_step is not None:
        _need(
            0 <= f.kill_rank < world_size,
            f"fault.kill_rank={f.kill_rank} is not a rank of this {world_size}-rank job",
        )
        _steps_in_run("fault.kill_step", [f.kill_step], job.trainer.max_steps)
    if f.preempt_step is not None:
        _steps_in_run("fault.preempt_step", [f.preempt_step], job.trainer.max_steps)


def _steps_in_run(key: str, steps: list[int], max_steps: int) -> None:
    # Step numbers start at 1, as the progress line's (docs/launcher.md, "Step numbers").
    bad = [s for s in steps if not 1 <= s <= max_steps]
    _need(
        not bad,
        f"{key} has {bad}, outside 1..trainer.max_steps={max_steps} (steps are numbered from 1, "
        "as the progress line counts them)",
    )


def check_known_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse keys the schema does not have, including ones added with Hydra's ``+key=value``.

    Without ``+`` Hydra already refuses them; with it they would be dropped without a word.
    """
    schema = OmegaConf.get_type(cfg)
    if dataclasses.is_dataclass(schema):
        known = [f.name for f in dataclasses.fields(schema)]
        for key in map(str, cfg):
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {prefix}{close[0]}? " if close else ""
                raise ConfigError(
                    f"{prefix}{key} is not a config key; {hint}see launch/schema.py for the keys"
                )
    for child in cfg:  # as they are: a dict keyed by int (fp8.schedule.switches) takes no str
        node, name = cfg._get_node(child), str(child)
        if isinstance(node, DictConfig) and f"{prefix}{name}" != "args":  # args: the user's
            check_known_keys(node, f"{prefix}{name}.")


def validate(job: JobConfig, typed: Iterable[str] = (), read_elsewhere: Iterable[str] = ()) -> int:
    """Check ``job`` in place (paths made absolute); return the resolved ``nproc_per_node``.

    ``typed``: the overrides of the command line (Hydra's task overrides); a key among them
    that this job would not read is refused (launch/applies.py), unless it is in
    ``read_elsewhere`` (another job of the same multirun reads it: launch/sweep.py).
    """
    _choices(job)
    _need(not (unused := unused_keys(job, typed, read_elsewhere)), unused or "")
    _entry(job)
    nproc = _launcher(job)
    _, max_nodes = parse_min_max_nnodes(job.launcher.nnodes)
    _trainer(job)
    _scaler(job)
    _model_and_data(job)
    _metrics(job, nproc)
    _checkpoint(job)
    _fault(job, nproc * max_nodes)
    _parallel(job, nproc)
    _fp8(job)
    _compile_step(job)
    return nproc


def _compile_step(job: JobConfig) -> None:
    """``trainer.compile_step=true``: the region compiles for this job's scaler, here first."""
    if not job.trainer.compile_step or not job.scaler.enabled:
        return
    _need(
        job.parallel.strategy in ("ddp", "fsdp", "single"),
        f"trainer.compile_step=true was not tried under parallel={job.parallel.strategy} (a mesh's "
        "placements or a pipeline schedule around the compiled region): use parallel=ddp, fsdp or "
        "single with it, or set trainer.compile_step=false",
    )
    _need(
        job.scaler.sync_free,
        "trainer.compile_step=true needs scaler.sync_free=true: the compiled region decides the "
        "skip on the device, and scaler.sync_free=false reads the agreed flag on the host every "
        "step, which ends a fullgraph region (docs/compiled-step.md); add scaler.sync_free=true, "
        "or set trainer.compile_step=false",
    )
    if job.trainer.precision == "fp8":
        from launch.fp8 import numerics_every

        parts = {
            "fp8.numerics_every=0": numerics_every(dataclasses.asdict(job.fp8)) > 0,
            "fp8.float8_all_gather=false": job.fp8.float8_all_gather,
        }
        wanted = [fix for fix, on in parts.items() if on]
        _need(
            not wanted,
            "trainer.compile_step=true compiles the scaler's step, but dscale.fp8's "
            "Float8Numerics and WeightScales do host work after every step (step callbacks) "
            'that cannot run inside a fullgraph region (docs/compiled-step.md, "FP8"): set '
            f"{' and '.join(wanted)}, or trainer.compile_step=false",
        )
    from launch.compiled_step import check_compiles
    from launch.integrations import build_scaler

    scaler = build_scaler(
        dataclasses.asdict(job.scaler), str(job.trainer.precision), torch.device("cpu")
    )
    try:
        check_compiles(scaler)
    except Exception as exc:  # dynamo's errors have many types; each is the answer here
        raise ConfigError(
            f"trainer.compile_step=true: this job's scaler step does not compile with "
            f"torch.compile(fullgraph=True): {type(exc).__name__}: {_first_lines(exc)}; "
            "or set trainer.compile_step=false to run it eagerly"
        ) from exc
    finally:
        torch._dynamo.reset()


def _first_lines(exc: BaseException, lines: int = 6) -> str:
    """The head of an error's message (dynamo appends long tracebacks and log hints)."""
    return "\n".join(str(exc).strip().splitlines()[:lines])


def _parallel(job: JobConfig, nproc: int) -> None:
    """The mesh's degrees against the world size, and the demo model against the mesh."""
    p = dataclasses.asdict(job.parallel)
    if p["strategy"] not in MESH_STRATEGIES:
        return
    min_nodes, max_nodes = parse_min_max_nnodes(job.launcher.nnodes)
    _need(
        min_nodes == max_nodes,
        f"parallel={p['strategy']} builds its mesh for one world size, but launcher.nnodes="
        f"{job.launcher.nnodes} lets it change: give a fixed number of nodes",
    )
    try:
        shape = mesh_shape(p, nproc * max_nodes)
        if job.script is None and job.entrypoint == DEMO_ENTRYPOINT:
            check_model(p, shape, dataclasses.asdict(job.model))
            check_batches(p, job.data.batch_size)
    except MeshError as exc:
        raise ConfigError(str(exc)) from None
    _need(
        job.trainer.precision != "fp8",
        f"trainer.precision=fp8 under parallel={p['strategy']} was not tried (torchao's float8 "
        "linears under a TP plan or pipeline stages): use fp16 or bf16, or parallel=fsdp for fp8",
    )
    _need(
        not (p["strategy"] == "pp" and job.fault.spike_steps),
        "fault.spike_steps multiplies the loss of the loop's forward, which parallel=pp runs "
        "inside its schedule: drop fault.spike_steps (fault.inf_steps works)",
    )


def _fp8(job: JobConfig) -> None:
    if job.trainer.precision != "fp8":
        return
    f = job.fp8
    every = f.numerics_every
    _need(
        every is None or every >= 0,
        f"fp8.numerics_every={every} must be >= 0 (sample every N steps; 0 turns it off)",
    )
    tokens = job.data.batch_size * job.data.seq_len
    _need(
        f.recipe != "mxfp8" or tokens % 32 == 0,
        f"fp8.recipe=mxfp8 trains on batches of data.batch_size x data.seq_len = "
        f"{job.data.batch_size} x {job.data.seq_len} = {tokens} tokens, which MXFP8's "
        "grad_weight GEMM blocks by 32: make the product a multiple of 32, or set "
        "fp8.recipe=mxfp8_wgrad_with_hp (grad_weight in high precision)",
    )
    _need(
        f.recipe != "nvfp4" or (torch.cuda.is_available() and f.emulate != "true"),
        "fp8.recipe=nvfp4 trains on torchao's NVFP4Linear, whose Triton kernels need a GPU "
        "(no emulation): run it on a GPU with fp8.emulate=auto or false, or pick "
        "fp8.recipe=mxfp8 (emulated on the CPU)",
    )
    _need(
        not f.float8_all_gather or job.parallel.strategy == "fsdp",
        "fp8.float8_all_gather=true all-gathers FSDP2's weight shards in float8: it needs "
        f"parallel=fsdp (this job has parallel={job.parallel.strategy})",
    )
    _need(
        not f.float8_all_gather or f.recipe == "tensorwise",
        f"fp8.float8_all_gather=true needs fp8.recipe=tensorwise (got {f.recipe}; the rowwise "
        "and MXFP8 recipes all-gather in high precision)",
    )
    _need(
        f.predict in ("bound", "exact"),
        f"fp8.predict={f.predict} is not bound or exact (how WeightScales sets the scale "
        "after a step)",
    )
    if f.schedule.initial or f.schedule.switches:
        _schedule(job)
    if f.fallback:
        _need(
            every != 0 and f.recipe == "tensorwise",
            "fp8.fallback=true decides from the sampled numerics: keep fp8.numerics_every "
            "above 0 (or unset) with fp8.recipe=tensorwise",
        )
        _need(
            0.0 < f.fallback_threshold < 1.0,
            f"fp8.fallback_threshold={f.fallback_threshold} must be a share in (0, 1), e.g. 0.01",
        )
        _need(
            f.fallback_samples >= 1,
            f"fp8.fallback_samples={f.fallback_samples} must be >= 1 (samples in a row)",
        )


def _schedule(job: JobConfig) -> None:
    """``fp8.schedule``: the layer names against the job's model (built here, on the CPU)."""
    import dscale.precision
    from launch.models import build_model

    s = job.fp8.schedule
    _need(
        job.parallel.strategy in ("single", "ddp"),
        f"fp8.schedule swaps layers' modules, which parallel={job.parallel.strategy} has "
        "wrapped: use parallel=ddp or single, or drop fp8.schedule",
    )
    _need(s.check_every >= 1, f"fp8.schedule.check_every={s.check_every} must be >= 1")
    _need(
        job.scaler.enabled,
        "fp8.schedule counts the steps of the job's scaler, which scaler.enabled=false turns "
        "off (no step callbacks, no collective): drop scaler.enabled=false or fp8.schedule",
    )
    model = build_model(dataclasses.asdict(job.model), job.data.seq_len)
    try:
        dscale.precision.check_schedule(model, dict(s.initial), dict(s.switches))
    except ValueError as exc:
        raise ConfigError(f"fp8.schedule: {exc}") from exc


def scaler_parameters() -> list[str]:
    """``dscale.GradScaler``'s keyword parameters that are config keys (all but device, group)."""
    params = inspect.signature(GradScaler).parameters
    return [name for name in params if name not in ("self", "device", "process_group")]


def _choices(job: JobConfig) -> None:
    """Every key with a fixed set of values (launch/choices.py), with the nearest one named."""
    problem = bad_choice(job)
    _need(problem is None, problem or "")
