"""The run's ``.hydra/`` record, written by the launcher once it starts workers.

Hydra writes ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` before it calls the
task function, so a command that then trains nothing (the run is complete, or the config is
refused) replaced the record of the run that trained. ``configs/job.yaml`` sets
``hydra.output_subdir: null`` and the launcher writes the same three files here, with Hydra's
contents, only when it goes on to start the workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

#: Where Hydra would write its record by default.
SUBDIR = ".hydra"

_started = False  # set when a job of this command starts workers (save_hydra_record)


def save_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Write Hydra's three files into ``run_dir/.hydra``, as Hydra's ``run_job`` would.

    A ``hydra.output_subdir=...`` on the command line is the user's own choice: Hydra has
    honoured it already (writing its record before the task, or none with ``null``), so nothing
    is written here then.
    """
    global _started
    _started = True
    hydra = HydraConfig.get()
    chosen = any(o.lstrip("+").startswith("hydra.output_subdir=") for o in hydra.overrides.hydra)
    if hydra.output_subdir is not None or chosen:
        return
    record = HydraConfig.instance().cfg  # {"hydra": ...}, what Hydra saves as hydra.yaml
    out = run_dir / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (
        ("config.yaml", cfg),
        ("hydra.yaml", record),
        ("overrides.yaml", hydra.overrides.task),
    ):
        (out / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


@contextlib.contextmanager
def multirun_record_kept(sweep_dir: Path | None) -> Iterator[None]:
    """Put ``sweep_dir/multirun.yaml`` back as it was (bytes and mtime) unless a job started.

    Hydra's sweeper rewrites the sweep's record before its first job, so a rerun of a complete
    sweep (every job at ``trainer.max_steps``), or one whose jobs are all refused, replaced the
    record of the sweep that trained with a command that trained nothing.
    """
    global _started
    _started = False
    path = sweep_dir / "multirun.yaml" if sweep_dir is not None else None
    before = (path.read_bytes(), path.stat()) if path is not None and path.is_file() else None
    try:
        yield
    finally:
        if path is not None and before is not None and not _started:
            data, info = before
            path.write_bytes(data)
            os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
