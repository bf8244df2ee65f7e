"""Prometheus file_sd targets for one run: written when the workers start, removed at the end.

``deploy/prometheus/prometheus-file-sd.yml`` reads ``targets/*.json``. Removing the file after a
normal finish keeps ``DScaleExporterDown`` from firing for a job that simply ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path


def scrape_host(addr: str) -> str:
    """The host Prometheus should scrape: the bind address, or this machine's name for 0.0.0.0."""
    return socket.getfqdn() if addr in ("0.0.0.0", "::", "") else addr


@contextlib.contextmanager
def published_targets(
    targets_dir: str | None, *, run_id: str, node_rank: int, host: str, ports: list[int]
) -> Iterator[Path | None]:
    """Write ``<targets_dir>/<run_id>-node<N>.json`` (atomically) for the block's duration."""
    if not targets_dir:
        yield None
        return
    folder = Path(targets_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_id}-node{node_rank}.json"
    group = {
        "targets": [f"{host}:{port}" for port in ports],
        "labels": {"run_id": run_id, "node": host},
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps([group], indent=2) + "\n")
    os.replace(tmp, path)  # Prometheus never reads a half-written file
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
