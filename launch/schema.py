"""Typed schema for every config node of the job, registered in Hydra's ConfigStore.

The dataclasses make Hydra reject unknown keys and wrong types while composing, before any process
starts. Values live in ``configs/``; the consumers (``launch/worker.py`` and the dscale library)
take plain arguments, never these objects' Hydra wrappers.
"""

from __future__ import annotations

import signal
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

import dscale
import dscale.fp8

# Choice fields are Enums: Hydra refuses any other value while composing, naming the key and
# listing the choices ("Invalid value 'fp4', expected one of [fp16, bf16, fp32, fp8]"). Member names
# equal their values, so the workers receive the plain strings.
#
# A str (or list[str]) field with a fixed set of values says so with ``metadata=choices(...)``:
# launch/choices.py reads both kinds from here, and every one of them is checked before any
# worker starts, with the nearest valid value named (tests/launch/test_choices.py covers each).


def choices(values: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Field metadata: the value (or, for a list, each element) must be one of ``values``."""
    return {"choices": values}


def library_choices(function: Callable[..., Any], argument: str) -> tuple[str, ...]:
    """The values of a ``Literal[...]`` argument of a dscale function: the library's own list."""
    values = typing.get_args(typing.get_type_hints(function)[argument])
    if not values:
        raise TypeError(f"{function.__qualname__}({argument}=...) is not a Literal")
    return tuple(str(v) for v in values)


#: Signal names a PreemptionGuard can handle (as ``checkpoint.save_on_signals`` spells them).
SIGNAL_NAMES = tuple(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))


class Choice(str, Enum):
    """A fixed-value key: prints as the value typed (``ddp``), never as ``Strategy.ddp``."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class StartMethod(Choice):
    """How torchelastic starts the local ranks (``--start-method``)."""

    spawn = "spawn"
    fork = "fork"
    forkserver = "forkserver"


class Strategy(Choice):
    """How ``ctx.parallelize(model)`` spreads the model over ranks (``parallel=``)."""

    single = "single"  # one process, no wrapper
    ddp = "ddp"  # DistributedDataParallel
    fsdp = "fsdp"  # FSDP2 fully_shard per block, then the root
    hsdp = "hsdp"  # FSDP2 on a (replicate, shard) mesh
    tp = "tp"  # tensor parallel over every rank
    pp = "pp"  # pipeline stages, one per rank
    # FSDP2 x TP on a (dp, tp) mesh. "2d" is no Python name; a class body's namespace takes it.
    locals()["2d"] = "2d"


class Precision(Choice):
    """The autocast dtype; fp16 gets a loss scaler, bf16 and fp32 a StepGuard (no scaling).

    fp8: bf16 autocast, the model's linears as torchao float8 ones (``fp8.*``), a StepGuard.
    """

    fp16 = "fp16"
    bf16 = "bf16"
    fp32 = "fp32"
    fp8 = "fp8"


class Device(Choice):
    """Where each rank runs: ``auto`` is the rank's GPU when CUDA is there, else the CPU."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class LauncherConfig:
    """torchrun's flags, with torchrun's defaults (not LaunchConfig's etcd / 3 restarts).

    ``configs/launcher/local.yaml`` fills these from the ``PET_*`` variables that torchrun reads and
    that Kubeflow sets, so the same command works in a pod.
    """

    nproc_per_node: str = "auto"  # N, or auto (one per GPU, else 2), cpu, gpu
    nnodes: str = "1"  # N or MIN:MAX
    node_rank: int = 0  # only used by the static backend, as in torchrun
    # static + one node + no endpoint = c10d on 127.0.0.1:0
    rdzv_backend: str = field(
        default="static", metadata=choices(("static", "c10d", "etcd", "etcd-v2"))
    )
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: str = ""  # k=v,k=v as torchrun's --rdzv-conf
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: StartMethod = StartMethod.spawn
    master_addr: str = "127.0.0.1"  # static backend on several nodes only
    master_port: int = 29500
    local_addr: str | None = None
    pg_timeout_s: float = 300.0  # init_process_group timeout, also bounds every collective


@dataclass
class ParallelConfig:
    """How the model is spread over ranks, and the degrees of its device mesh.

    The degrees multiply to the world size; the data-parallel degree is what is left over
    (``parallel=2d parallel.tp=2`` on 8 ranks: 4 x 2). ``launch/mesh.py`` checks them against
    the world size and the model before any worker starts.

    ``tp``: ranks per tensor-parallel group (``tp``: all of them; ``2d``: the inner mesh dim).
    ``replicate``: ``hsdp``'s replicas; each shards over world / replicate ranks.
    ``pp``: pipeline stages (``pp``: all ranks); ``schedule`` and ``microbatches`` are
    ``torch.distributed.pipelining``'s (``gpipe`` or ``1f1b``; microbatches divide
    ``data.batch_size``).
    """

    strategy: Strategy = Strategy.ddp
    tp: int = 1
    replicate: int = 1
    pp: int = 1
    schedule: str = field(default="1f1b", metadata=choices(("gpipe", "1f1b")))
    microbatches: int = 4


@dataclass
class ModelConfig:
    """Fields shared by every model; ``name`` picks the builder in ``launch/models.py``."""

    name: str = MISSING
    vocab_size: int = 256
    d_model: int = 64


@dataclass
class MLPConfig(ModelConfig):
    """A per-token MLP: embedding, hidden layers, logits. The smallest thing that trains."""

    name: str = "mlp"
    hidden: int = 256
    n_layers: int = 2


@dataclass
class GPTConfig(ModelConfig):
    """A small decoder-only transformer (pre-norm, causal self-attention)."""

    name: str = "gpt_small"
    n_layers: int = 2
    n_heads: int = 4


@dataclass
class DataConfig:
    """Token batches of ``seq_len`` + 1 bytes; ``name`` picks the source in ``launch/data.py``."""

    name: str = MISSING
    seq_len: int = 64
    batch_size: int = 8  # per rank


@dataclass
class SyntheticDataConfig(DataConfig):
    """Text-like byte sequences generated on the fly from a fixed rule plus noise (learnable)."""

    name: str = "synthetic"
    noise: float = 0.1


@dataclass
class TextDataConfig(DataConfig):
    """Random windows of a plain text file, one byte per token."""

    name: str = "text"
    path: str = MISSING


@dataclass
class ScalerConfig:
    """Every field is a ``dscale.GradScaler`` keyword argument of the same name and default.

    ``device`` and ``process_group`` are not config: the worker picks them. A bf16 or fp32 job
    builds a ``dscale.StepGuard`` from the fields it takes (enabled, sync_free, stuck_patience
    and the spike gate's): the same agreed skips, no scaling.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    hysteresis_refill: str = field(
        default="on_growth",
        metadata=choices(library_choices(dscale.GradScaler.__init__, "hysteresis_refill")),
    )
    on_stuck_at_min: str = field(
        default="warn",
        metadata=choices(library_choices(dscale.GradScaler.__init__, "on_stuck_at_min")),
    )
    stuck_patience: int = 100
    sync_free: bool = False
    # or "predictive": the scale from the measured gradient range
    policy: str = field(
        default="dynamic", metadata=choices(library_choices(dscale.GradScaler.__init__, "policy"))
    )
    predictive_window: int | None = None  # predictive: steps of measurements (None: 8)
    # The spike gate, off while spike_signals is empty; e.g. scaler.spike_signals=[loss,grad_norm]
    spike_signals: list[str] = field(default_factory=list, metadata=choices(("loss", "grad_norm")))
    spike_sigma: float = 6.0
    spike_window: int = 128
    spike_warmup: int = 64


@dataclass
class TrainerConfig:
    """The loop: how long, in which precision, how chatty.

    ``compile_step``: compile the post-backward region (``scaler.step`` + ``scaler.update``) with
    ``torch.compile(fullgraph=True)`` after an eager warm-up step (docs/compiled-step.md);
    ``compile_backend``: torch.compile's backend for it.
    """

    max_steps: int = 300
    precision: Precision = Precision.fp16
    log_every: int = 25
    seed: int = 0
    lr: float = 3e-3
    device: Device = Device.auto
    compile_step: bool = False
    compile_backend: str = field(
        default="inductor", metadata=choices(("inductor", "aot_eager", "eager"))
    )


@dataclass
class PrecisionScheduleConfig:
    """``fp8.schedule``: a ``dscale.precision.PrecisionSchedule`` (off while ``initial`` is empty).

    ``initial``: layer name -> format at step 0 (``{blocks.0.mlp.fc1: mxfp8}``); ``switches``:
    step -> changes (``{900: {blocks.0.mlp.fc1: bf16_forward}}``); formats are
    ``dscale.precision.FORMATS``; ``check_every``: compare the ranks' maps every N steps.
    """

    initial: dict[str, str] = field(default_factory=dict)
    switches: dict[int, dict[str, str]] = field(default_factory=dict)
    check_every: int = 16


@dataclass
class FP8Config:
    """``trainer.precision=fp8``: ``dscale.fp8.convert_to_float8`` arguments of the same name.

    ``recipe``: tensorwise, rowwise, mxfp8 or mxfp8_wgrad_with_hp (torchao's MXFP8Linear), or
    nvfp4 (torchao's NVFP4Linear; a GPU only, with ``dscale.fp8.NVFP4Seeds``).
    ``emulate``: auto (torchao's emulation on the CPU, FP8 GEMMs on a GPU), true or false.
    ``numerics_every``: sample ``dscale.fp8.Float8Numerics`` every N steps (served, logged to
    ``metrics/fp8-rank<R>.jsonl``); None: 100 with the tensorwise recipe, off with the others
    (which it measures per row or per block of 32 when set); 0 off.
    ``float8_all_gather``: FSDP2 all-gathers the float8 weights, with ``dscale.fp8.WeightScales``
    agreeing their scales in the scaler's one collective (``parallel=fsdp``, tensorwise).
    ``predict``: how WeightScales sets the post-step scale: ``bound`` (Adam's update bound) or
    ``exact`` (from the post-step weights, computed before the step).
    ``fallback``: ``dscale.fp8.Float8Fallback`` with ``fallback_threshold`` and
    ``fallback_samples`` (needs the numerics). Their state goes into the job's checkpoints.
    ``schedule``: a per-layer precision schedule (:class:`PrecisionScheduleConfig`).
    """

    recipe: str = field(
        default="tensorwise",
        metadata=choices(library_choices(dscale.fp8.convert_to_float8, "recipe")),
    )
    keep_high_precision: list[str] = field(default_factory=lambda: ["head"])
    emulate: str = field(default="auto", metadata=choices(("auto", "true", "false")))
    numerics_every: int | None = None
    float8_all_gather: bool = False
    predict: str = field(default="bound", metadata=choices(("bound", "exact")))
    fallback: bool = False
    fallback_threshold: float = 0.01
    fallback_samples: int = 3
    schedule: PrecisionScheduleConfig = field(default_factory=PrecisionScheduleConfig)


@dataclass
class MetricsConfig:
    """Per-rank Prometheus endpoint: rank r serves on ``port`` + local rank."""

    enabled: bool = True
    addr: str = "127.0.0.1"
    port: int = 19400  # dscale.metrics.DEFAULT_PORT
    linger_s: float = 0.0  # keep serving after the last step so a scraper sees final values
    check_agreement_every: int = 100  # compare the scale across ranks every N steps; 0: never
    targets_dir: str | None = None  # write Prometheus file_sd targets here while the job runs
    tensorboard: bool = False  # also write the loop's figures to run_dir/tensorboard/rank<r>


@dataclass
class CheckpointConfig:
    """Sharded (DCP) checkpoints; ``resume`` is auto (latest in ``dir``), none, or a path.

    ``save_on_signals``: on any of these signals (a scheduler's preemption notice) every rank
    finishes its step, saves, and the job exits with status 75 so that it is restarted; [] turns
    this off. See ``dscale.checkpoint.PreemptionGuard``. ``async_save``: write in the background
    (``CheckpointManager(async_save=True)``); a preemption save is published before the exit.
    """

    enabled: bool = True
    dir: str = MISSING
    every: int = 100
    keep: int = 2
    resume: str = "auto"
    save_on_signals: list[str] = field(
        default_factory=lambda: ["SIGTERM"], metadata=choices(SIGNAL_NAMES)
    )
    async_save: bool = False


@dataclass
class FaultConfig:
    """Fault injection, so users can watch the ranks agree and the job survive.

    ``inf_steps``: put an inf into rank ``inf_rank``'s gradients at these steps (any precision).
    ``spike_steps``: multiply rank ``spike_rank``'s loss by ``spike_factor`` at these steps, to
    watch the spike gate (``scaler.spike_signals``) skip them on every rank.
    ``kill_step``: rank ``kill_rank`` SIGKILLs itself when it reaches this step, in each of the
    first ``kill_attempts`` attempts (restarts count as attempts), to exercise elastic restarts.
    ``preempt_step``: rank 0 sends SIGTERM to the launcher when it reaches this step (first
    attempt only), as a scheduler preempting the job would.
    Steps are numbered from 1 to ``trainer.max_steps``, as the progress line and the skip lines
    print them: ``inf_steps=[10]`` is the 10th step.
    """

    inf_steps: list[int] = field(default_factory=list)
    inf_rank: int = 1
    spike_steps: list[int] = field(default_factory=list)
    spike_rank: int = 1
    spike_factor: float = 1000.0
    kill_step: int | None = None
    kill_rank: int = 1
    kill_attempts: int = 1
    preempt_step: int | None = None


DEMO_ENTRYPOINT = "launch.demo:main"


@dataclass
class JobConfig:
    """The whole job. Groups (launcher, parallel, model, data) come from the defaults list.

    What runs on every rank: ``entrypoint`` (``module:function``, called with the run context;
    the built-in demo by default) or ``script`` (a torchrun script, run unchanged with
    ``script_args``). ``args`` is the user's own free-form node; only it skips the schema.
    ``model`` and ``data`` configure the demo.
    """

    entrypoint: str = DEMO_ENTRYPOINT
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    launcher: LauncherConfig = MISSING
    parallel: ParallelConfig = MISSING
    model: Any = MISSING
    data: Any = MISSING
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)


def register() -> None:
    """Store the schema so that ``configs/*.yaml`` can extend it through their defaults lists."""
    cs = ConfigStore.instance()
    cs.store(name="base_job", node=JobConfig)
    cs.store(group="launcher", name="base_launcher", node=LauncherConfig)
    cs.store(group="parallel", name="base_parallel", node=ParallelConfig)
    cs.store(group="model", name="base_mlp", node=MLPConfig)
    cs.store(group="model", name="base_gpt", node=GPTConfig)
    cs.store(group="data", name="base_synthetic", node=SyntheticDataConfig)
    cs.store(group="data", name="base_text", node=TextDataConfig)
