"""Prometheus file_sd targets: one file per port a rank actually serves, while it serves it.

``deploy/prometheus/prometheus-file-sd.yml`` reads ``targets/*.json``. Each rank publishes its
own target *after* its exporter has bound the port, and removes it when the exporter stops, so
a target never names a port that another job holds: with two jobs on one node and the same
``metrics.port``, the second job's ranks cannot bind it and publish nothing (their log says
"cannot serve on"), instead of sending Prometheus to the first job's ranks under the second
job's ``run_id``. The launcher removes its node's leftovers (a rank killed by SIGKILL) at the
end. Removing the files after a normal finish keeps ``DScaleExporterDown`` from firing for a
job that simply ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path


def scrape_host(addr: str) -> str:
    """The host Prometheus should scrape: the bind address, or this machine's name for 0.0.0.0."""
    return socket.getfqdn() if addr in ("0.0.0.0", "::", "") else addr


def target_file(targets_dir: str | Path, *, run_id: str, host: str, port: int) -> Path:
    """``<targets_dir>/<run_id>-<host>-<port>.json``: one per served port, unique on a cluster."""
    return Path(targets_dir) / f"{run_id}-{host}-{port}.json"


@contextlib.contextmanager
def published_target(
    targets_dir: str | None,
    *,
    run_id: str,
    host: str,
    port: int | None,
    rank: int,
    job_name: str | None = None,
) -> Iterator[Path | None]:
    """Write this rank's target (atomically) for the block's duration; nothing if ``port`` is None.

    Call it once the port is bound. The target's labels (``job_name``, ``run_id``, ``rank``,
    ``node``) are the exporter's own, so that ``up`` and ``DScaleExporterDown`` carry them too.
    """
    if not targets_dir or port is None:
        yield None
        return
    path = target_file(targets_dir, run_id=run_id, host=host, port=port)
    path.parent.mkdir(parents=True, exist_ok=True)
    group = {
        "targets": [f"{host}:{port}"],
        "labels": {
            "job_name": job_name or run_id,
            "run_id": run_id,
            "rank": str(rank),
            "node": host,
        },
    }
    tmp = path.with_name(f".{path.name}.tmp")  # not *.json: Prometheus never reads it
    tmp.write_text(json.dumps([group], indent=2) + "\n")
    os.replace(tmp, path)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def remove_targets(
    targets_dir: str | None, *, run_id: str, host: str, ports: Iterable[int]
) -> None:
    """Remove the targets this node's ranks may have left (a rank killed before its cleanup)."""
    if not targets_dir:
        return
    for port in ports:
        target_file(targets_dir, run_id=run_id, host=host, port=port).unlink(missing_ok=True)
