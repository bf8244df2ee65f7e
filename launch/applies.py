"""Keys that only apply under another setting: typed without it, they are refused.

Nothing reads ``fp8.*`` unless ``trainer.precision=fp8``, so ``fp8.float8_all_gather=true`` on a
bf16 job trained plain bf16 and exited 0. Each rule here names keys, the setting they need, and
how to read it from the job; a key typed on the command line (Hydra's task overrides) whose
setting does not hold is refused before any worker starts, naming that setting.

Values set in a YAML file are not "typed": a config of your own may set ``fp8.*`` for the runs
that turn fp8 on. ``checkpoint.dir`` is exempt (scripts set it whether or not checkpoints are on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from torch.distributed.run import parse_min_max_nnodes

from launch.integrations import STEP_GUARD_FIELDS
from launch.schema import DEMO_ENTRYPOINT, JobConfig, ScalerConfig


@dataclass(frozen=True)
class Needs:
    """``keys`` (a key, or a ``node.`` prefix for all of its keys but ``exempt``) apply only
    when ``holds(job)``; ``setting`` says what that takes, as it is typed."""

    keys: tuple[str, ...]
    setting: str
    holds: Callable[[JobConfig], bool]
    exempt: tuple[str, ...] = ()

    def covers(self, key: str) -> bool:
        return key not in self.exempt and any(
            key == k or (k.endswith(".") and key.startswith(k)) for k in self.keys
        )


_LOSS_SCALE_KEYS = tuple(
    f"scaler.{name}" for name in ScalerConfig.__dataclass_fields__ if name not in STEP_GUARD_FIELDS
)


def _one_node_standalone(job: JobConfig) -> bool:
    """launch/elastic.py's torchrun --standalone case: one node, no endpoint, static or c10d."""
    lc = job.launcher
    try:
        one_node = parse_min_max_nnodes(lc.nnodes)[1] == 1
    except (ValueError, RuntimeError):  # validate() names a bad launcher.nnodes
        one_node = False
    return lc.rdzv_backend in ("static", "c10d") and not lc.rdzv_endpoint and one_node


RULES: tuple[Needs, ...] = (
    Needs(("fp8.",), "trainer.precision=fp8", lambda j: j.trainer.precision == "fp8"),
    Needs(("fp8.predict",), "fp8.float8_all_gather=true", lambda j: j.fp8.float8_all_gather),
    Needs(
        ("fp8.fallback_threshold", "fp8.fallback_samples"),
        "fp8.fallback=true",
        lambda j: j.fp8.fallback,
    ),
    Needs(("scaler.",), "scaler.enabled=true", lambda j: j.scaler.enabled, ("scaler.enabled",)),
    Needs(
        _LOSS_SCALE_KEYS,
        "trainer.precision=fp16 (bf16, fp32 and fp8 get a StepGuard, which has no loss scale)",
        lambda j: j.trainer.precision == "fp16",
    ),
    Needs(
        ("scaler.predictive_window",),
        "scaler.policy=predictive",
        lambda j: j.scaler.policy == "predictive",
    ),
    Needs(
        ("scaler.spike_sigma", "scaler.spike_window", "scaler.spike_warmup"),
        "scaler.spike_signals=[loss] or [grad_norm] (the spike gate)",
        lambda j: bool(j.scaler.spike_signals),
    ),
    Needs(
        ("scaler.on_stuck_at_min", "scaler.stuck_patience"),
        "scaler.min_scale=... (a scale can only be stuck at a minimum)",
        lambda j: j.scaler.min_scale is not None or j.trainer.precision != "fp16",
    ),
    Needs(
        ("trainer.compile_step", "trainer.compile_backend"),
        f"entrypoint={DEMO_ENTRYPOINT} (the launcher's own loop; a loop of your own compiles its "
        "step itself, as docs/compiled-step.md shows)",
        lambda j: j.script is None and j.entrypoint == DEMO_ENTRYPOINT,
    ),
    Needs(
        ("trainer.compile_backend",),
        "trainer.compile_step=true",
        lambda j: j.trainer.compile_step,
    ),
    Needs(("fault.inf_rank",), "fault.inf_steps=[...]", lambda j: bool(j.fault.inf_steps)),
    Needs(
        ("fault.spike_rank", "fault.spike_factor"),
        "fault.spike_steps=[...]",
        lambda j: bool(j.fault.spike_steps),
    ),
    Needs(
        ("fault.kill_rank", "fault.kill_attempts"),
        "fault.kill_step=N",
        lambda j: j.fault.kill_step is not None,
    ),
    # Where the exporter binds is a deployment's setting (the Slurm and Kubernetes files set it
    # for every job), not a choice a job with metrics off got wrong.
    Needs(
        ("metrics.",),
        "metrics.enabled=true",
        lambda j: j.metrics.enabled,
        ("metrics.enabled", "metrics.addr", "metrics.port"),
    ),
    Needs(
        ("metrics.",),
        "scaler.enabled=true (the exporter serves the scaler's figures)",
        lambda j: j.scaler.enabled,
        ("metrics.enabled", "metrics.addr", "metrics.port"),
    ),
    Needs(
        ("checkpoint.",),
        "checkpoint.enabled=true",
        lambda j: j.checkpoint.enabled,
        ("checkpoint.enabled", "checkpoint.dir"),
    ),
    Needs(("script_args",), "script=PATH", lambda j: j.script is not None),
    Needs(
        ("launcher.master_addr", "launcher.master_port"),
        "launcher.rdzv_backend=static on several nodes (launcher.nnodes) without "
        "launcher.rdzv_endpoint (an endpoint is the store's address; one node without one gets "
        "a private c10d store)",
        lambda j: (
            j.launcher.rdzv_backend == "static"
            and not _one_node_standalone(j)
            and not j.launcher.rdzv_endpoint
        ),
    ),
    Needs(
        ("launcher.node_rank",),
        "launcher.rdzv_backend=static on several nodes (launcher.nnodes) or with "
        "launcher.rdzv_endpoint (one node without an endpoint gets a private c10d store)",
        lambda j: j.launcher.rdzv_backend == "static" and not _one_node_standalone(j),
    ),
)


def typed_keys(overrides: Iterable[str]) -> dict[str, str]:
    """``{key: override as typed}`` for Hydra's task overrides (``+k=v``, ``~k`` included).

    A node given a dict (``fp8={float8_all_gather:true}``) types each of its leaves
    (``fp8.float8_all_gather``), as ``fp8.float8_all_gather=true`` would.
    """
    parser = OverridesParser.create()
    found: dict[str, str] = {}
    for typed in overrides:
        try:
            (override,) = parser.parse_overrides([typed])
        except Exception:  # not Hydra's syntax (Hydra refused it before): its key as written
            found[typed.lstrip("+~").split("=", 1)[0]] = typed
            continue
        value = None if override.is_sweep_override() else override.value()
        for key in _leaves(override.key_or_group, value):
            found[key] = typed
    return found


def _leaves(key: str, value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [key]


def unused(job: JobConfig, overrides: Iterable[str]) -> dict[str, str]:
    """``{key: why}`` for each typed key that ``job`` would not use."""
    problems = {}
    for key, typed in typed_keys(overrides).items():
        missing = [r.setting for r in RULES if r.covers(key) and not r.holds(job)]
        if missing:
            problems[key] = (
                f"{typed} is read only with {' and '.join(missing)}, so this job would ignore "
                f"it: add that, or drop {key}"
            )
    return problems


def unused_keys(
    job: JobConfig, overrides: Iterable[str], read_elsewhere: Iterable[str] = ()
) -> str | None:
    """Typed keys that ``job`` would not use, each with the settings it needs; None if none.

    ``read_elsewhere``: keys another job of the same multirun reads (launch/sweep.py); a sweep
    over ``trainer.precision=fp8,bf16`` types ``fp8.*`` for its fp8 jobs.
    """
    skip = set(read_elsewhere)
    return "; ".join(v for k, v in unused(job, overrides).items() if k not in skip) or None
