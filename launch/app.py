"""``python -m launch`` / ``dscale-launch``: compose the config, validate, run the elastic job.

The Hydra task function itself calls ``elastic_launch`` (a Hydra Launcher plugin is consulted only
in multirun), so a plain run starts one torchrun-style job and ``-m`` runs one job after another,
each in its own output folder.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, cast

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_min_max_nnodes

from launch.context import JOB_NAME_ENV
from launch.elastic import (
    launch_config,
    process_logs_to_file,
    run_script,
    run_workers,
    worker_env,
)
from launch.failures import explain_failure
from launch.hydra_record import multirun_record_kept, save_hydra_record
from launch.preemption import PREEMPTED_EXIT_CODE, failures_were_preemption
from launch.rerun import (
    check_same_job,
    discard_refused_run_dir,
    nothing_to_train,
    resume_advice,
    world_size_change,
)
from launch.schema import JobConfig, register
from launch.summary import build_summary, format_summary, write_summary
from launch.sweep import read_elsewhere, sweep_dir, sweep_problem
from launch.targets import remove_targets, scrape_host
from launch.typos import misspelt_key
from launch.validate import ConfigError, check_known_keys, validate
from launch.worker import script_report_path

logger = logging.getLogger("launch")

register()

# Absolute, so the same configs load from a clone, ``python -m launch`` and the installed script
# (a relative path is read as a Python package when Hydra is called from a module).
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def _run(job: JobConfig, plain: dict[str, Any], nproc: int, run_dir: Path) -> dict[int, Any]:
    config = launch_config(job.launcher, nproc, run_dir)
    worker_env(nproc, run_dir)
    logger.info(
        "starting %d local ranks of %s (%s rendezvous at %s, max_restarts=%d) in %s",
        nproc,
        f"script {job.script}" if job.script else job.entrypoint,
        config.rdzv_backend,
        config.rdzv_endpoint,
        config.max_restarts,
        run_dir,
    )
    m = job.metrics
    # Each rank publishes its own file_sd target once its port is bound (launch/targets.py);
    # here only what a killed rank left behind is removed.
    try:
        with process_logs_to_file(run_dir):
            if job.script:
                return run_script(config, job.script, job.script_args)
            return run_workers(config, plain, run_dir)
    finally:
        remove_targets(
            m.targets_dir if m.enabled else None,
            run_id=config.run_id,
            host=scrape_host(m.addr),
            ports=[m.port + r for r in range(nproc)],
        )


def script_report(run_dir: Path, rank: int) -> dict[str, Any]:
    """A script rank's record: what its ``launch.get_context()`` wrote at exit, else its rank."""
    path = script_report_path(run_dir, rank)
    if not path.is_file():  # the script never asked for the context
        return {"rank": rank}
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def run_job(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Validate, launch, summarise; None on a node that does not hold global rank 0, or when
    the run's checkpoint is already at ``trainer.max_steps`` (nothing is launched then)."""
    check_known_keys(cfg)
    job = cast(JobConfig, OmegaConf.to_object(cfg))  # Hydra built it from launch/schema.py
    nproc = validate(job, typed=HydraConfig.get().overrides.task, read_elsewhere=read_elsewhere())
    # A plain dict crosses into the workers: picklable, fully resolved, no Hydra needed there.
    plain = cast(
        dict[str, Any],
        OmegaConf.to_container(OmegaConf.structured(job), resolve=True, enum_to_str=True),
    )
    check_same_job(run_dir, plain)  # before this run's config replaces the earlier one's
    done = nothing_to_train(plain)
    if done:  # nothing is started, saved or overwritten: the earlier run's files stay as they are
        print(done)
        return None
    min_nodes, max_nodes = parse_min_max_nnodes(job.launcher.nnodes)
    resized = world_size_change(plain, nproc * max_nodes) if min_nodes == max_nodes else None
    if resized:
        logger.warning("%s", resized)
    save_hydra_record(cfg, run_dir)  # only now: a run that stops above writes nothing
    (run_dir / "config.resolved.yaml").write_text(OmegaConf.to_yaml(plain))
    if job.script:  # an earlier run's records in this folder are not this run's
        for stale in run_dir.glob("logs/rank*.report.json"):
            stale.unlink()
    results = _run(job, plain, nproc, run_dir)
    if 0 not in results:
        print(
            f"dscale job finished on this node (ranks {sorted(results)}, logs in {run_dir}/logs); "
            "the node holding rank 0 writes summary.json"
        )
        return None
    if job.script:
        ranks = [script_report(run_dir, r) for r in sorted(results)]
        f = job.fault
        if any(len(r) == 1 for r in ranks) and (
            f.inf_steps or f.spike_steps or f.kill_step is not None or f.preempt_step is not None
        ):
            logger.warning(
                "fault.* was set, but the script never called launch.get_context(), so no fault "
                "was injected and summary.json has no scale or skipped steps: call "
                "ctx = launch.get_context() and ctx.faults.after_backward(step, model) (see "
                "tests/launch/torchrun_script.py)"
            )
        summary = build_summary(
            ranks,
            run_dir=run_dir,
            what={"script": job.script, "script_args": job.script_args},
            world_size=nproc * max_nodes if min_nodes == max_nodes else None,
        )
    else:
        summary = build_summary(
            results[0]["ranks"], run_dir=run_dir, what={"entrypoint": job.entrypoint}
        )
    write_summary(summary, run_dir)
    print(format_summary(summary))
    return summary


def main() -> None:
    """Entry point of ``python -m launch`` and ``dscale-launch``.

    A mistyped key is named with its likely fix first (launch/typos.py), and every job of a
    multirun is checked before the first starts (launch/sweep.py); then Hydra composes.
    """
    hint = misspelt_key(sys.argv[1:], CONFIG_DIR, "job") or sweep_problem(
        sys.argv[1:], CONFIG_DIR, "job"
    )
    if hint:
        print(f"dscale-launch: bad config: {hint}", file=sys.stderr)
        sys.exit(2)
    with multirun_record_kept(sweep_dir(sys.argv[1:], CONFIG_DIR, "job")):
        _hydra_main()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="job")
def _hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    os.environ[JOB_NAME_ENV] = hydra_cfg.job.name  # the workers' metrics label
    try:
        run_job(cfg, run_dir)
    except ConfigError as exc:
        print(f"dscale-launch: bad config: {exc}", file=sys.stderr)
        discard_refused_run_dir(run_dir)  # nothing ran: no folder that looks like a run
        sys.exit(2)
    except SignalException as exc:
        print(
            f"dscale-launch: stopped by {exc.sigval.name}; the workers saved a checkpoint if "
            f"they had time (checkpoint.save_on_signals). Exiting with {PREEMPTED_EXIT_CODE} "
            f"so that the job is restarted;\n{resume_advice(cfg.checkpoint)}",
            file=sys.stderr,
        )
        sys.exit(PREEMPTED_EXIT_CODE)
    except ChildFailedError as exc:
        if failures_were_preemption([f.exitcode for f in exc.failures.values()]):
            print(
                f"dscale-launch: the workers were preempted and saved a checkpoint; exiting "
                f"with {PREEMPTED_EXIT_CODE} so that the job is restarted;\n"
                f"{resume_advice(cfg.checkpoint)}",
                file=sys.stderr,
            )
            sys.exit(PREEMPTED_EXIT_CODE)
        # The cause first (no traceback reached the terminal before it); torchelastic's report
        # with every rank's traceback goes to a file this names.
        report = run_dir / "torchelastic" / "failure.txt"
        report.write_text(exc.format_msg() + "\n")  # type: ignore[no-untyped-call]
        cause = explain_failure(exc)
        print(
            f"dscale-launch: {cause}\n"
            f"  logs: {run_dir}/logs/rank<R>.log; torchelastic's report: {report}\n"
            f"after fixing the cause, {resume_advice(cfg.checkpoint, failure=cause)}",
            file=sys.stderr,
        )
        sys.exit(1)
