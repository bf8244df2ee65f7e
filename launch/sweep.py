"""A multirun's jobs, checked before the first one starts.

Hydra runs ``-m`` jobs one after another, and the launcher's own checks (launch/choices.py,
launch/applies.py) ran inside each job: ``-m fp8.recipe=tensorwise,rowwis`` trained the first job
to the end and only then refused the second. Here every job of the sweep is composed first (the
cartesian product of its sweep overrides, as Hydra's basic sweeper forms it) and checked: a value
outside its set in any job, or a typed key that no job of the sweep reads, is refused before any
worker starts. A key that some jobs read (``-m trainer.precision=fp8,bf16 fp8.recipe=rowwise``)
is typed for those jobs; the others ignore it, and :func:`read_elsewhere` says which keys those are.
Like launch/typos.py, this reads the launcher's own configs: with ``--config-dir`` the checks
run in each job, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from launch.applies import unused
from launch.choices import bad_choice
from launch.schema import JobConfig
from launch.typos import OTHER_CONFIGS, outside_an_enum, primary_name

_MULTIRUN = ("-m", "--multirun")
# Keys typed for the sweep that some of its jobs read; the others ignore them (set by main()).
_READ_ELSEWHERE: set[str] = set()


def read_elsewhere() -> frozenset[str]:
    """Typed keys that another job of this multirun reads (see :func:`sweep_problem`)."""
    return frozenset(_READ_ELSEWHERE)


def jobs(argv: Sequence[str]) -> list[list[str]] | None:
    """Each job's overrides (``hydra.*`` left out) of a ``-m`` command line; None if not one."""
    if not any(a in _MULTIRUN for a in argv):
        return None
    lines = [a for a in argv if ("=" in a and not a.startswith("-")) or a.startswith("~")]
    parsed = OverridesParser.create().parse_overrides(lines)
    axes = [
        (
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [str(o.input_line)]
        )
        for o in parsed
        if not o.key_or_group.startswith("hydra.")
    ]
    return [list(job) for job in itertools.product(*axes)]


def sweep_problem(argv: Sequence[str], config_dir: str, name: str) -> str | None:
    """The first job's refusal, in the launcher's words, when any job of a multirun would be
    refused; None otherwise (and for a plain run, or one Hydra refuses in its own words)."""
    _READ_ELSEWHERE.clear()
    if any(a.split("=", 1)[0] in OTHER_CONFIGS for a in argv):
        return None
    if GlobalHydra.instance().is_initialized():  # a caller's own Hydra session: not ours to end
        return None
    try:
        each = jobs(argv)
    except Exception:  # Hydra words a malformed override or an unusual sweep itself
        return None
    if each is None or len(each) < 2:
        return None
    ignored: list[dict[str, str]] = []
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        for overrides in each:
            try:
                cfg = compose(primary_name(argv, name), overrides)
                _without_hydras_values(cfg)
                job = cast(JobConfig, OmegaConf.to_object(cfg))
            except Exception as exc:
                said = outside_an_enum(exc)
                if said:
                    return said
                return None  # Hydra's own refusal, before any job starts
            said = bad_choice(job)
            if said:
                return said
            ignored.append(unused(job, overrides))
    for key in ignored[0]:
        if all(key in found for found in ignored):
            return f"{ignored[0][key]} (in every job of this multirun)"
    _READ_ELSEWHERE.update(key for found in ignored for key in found)
    return None


def _without_hydras_values(cfg: DictConfig) -> None:
    """Replace values read from Hydra's run (``${hydra:runtime.output_dir}/checkpoints``), which
    only a running job resolves, with their text: the checks here read no path."""
    for key in list(cfg.keys()):
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            _without_hydras_values(node)
        elif node is not None and node._is_interpolation() and "hydra:" in str(node._value()):
            try:
                cfg[key] = str(node._value()).replace("${", "$[")
            except Exception:  # not a str field: the job's own check resolves it
                pass


def sweep_dir(argv: Sequence[str], config_dir: str, name: str) -> Path | None:
    """The folder a ``-m`` command's sweep writes ``multirun.yaml`` into (``hydra.sweep.dir``,
    resolved as Hydra will); None for a plain run, ``--config-dir`` or a folder not known here."""
    if not any(a in _MULTIRUN for a in argv) or GlobalHydra.instance().is_initialized():
        return None
    if any(a.split("=", 1)[0] in OTHER_CONFIGS for a in argv):
        return None
    hydra_keys = [a for a in argv if a.startswith("hydra.") and "=" in a]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(primary_name(argv, name), hydra_keys, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)  # what ${hydra:job.name} reads
            return Path(str(OmegaConf.select(cfg, "hydra.sweep.dir")))
    except Exception:  # Hydra words its own refusals
        return None
