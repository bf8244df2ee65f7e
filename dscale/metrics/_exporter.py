"""start_exporter(): wire a scaler (and stats) to a per-rank Prometheus endpoint."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import types
from typing import Any

import torch
from prometheus_client import CollectorRegistry

import dscale
from dscale.fp8._collector import AttachedFloat8Collector
from dscale.metrics import _server
from dscale.metrics._collector import ScalerCollector
from dscale.metrics._rank_check import RankScaleCheck
from dscale.metrics._training import TrainingFigures
from dscale.precision._collector import AttachedShadowCollector
from dscale.stats import NumericsStats

logger = logging.getLogger(__name__)

#: Base port; rank ``local_rank`` serves on ``DEFAULT_PORT + local_rank``. Chosen away from
#: dcgm-exporter (9400), Prometheus (9090), node_exporter (9100), the 9100-9999 range of allocated
#: exporter ports, c10d (29400, 29500) and Linux's ephemeral range (32768+).
DEFAULT_PORT = 19400


class MetricsExporter:
    """A running per-rank exporter; ``stop()`` it, or use it as a context manager.

    ``port`` is None when the port could not be bound (a warning was logged). ``stop()`` keeps
    serving for ``linger_s`` seconds first, so Prometheus scrapes the final values.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        collector: ScalerCollector,
        server: Any,
        rank_check: RankScaleCheck | None,
        *,
        addr: str,
        port: int | None,
        linger_s: float,
    ) -> None:
        self.registry = registry
        self.collector = collector
        self.rank_check = rank_check
        self.addr = addr
        self.port = port
        self.linger_s = linger_s
        self._server = server
        self._stop_now = threading.Event()
        self._lingering = threading.Event()  # set while stop() waits; tests wait on it
        self._lock = threading.Lock()

    @property
    def url(self) -> str | None:
        """Where /metrics is served, or None if not serving."""
        if self.port is None or self._server is None:
            return None
        return f"http://{self.addr}:{self.port}/metrics"

    def stop(self, linger_s: float | None = None) -> None:
        """Keep serving for ``linger_s`` (default: the exporter's), then stop and free the port.

        Blocks the caller while it lingers; a concurrent ``stop(linger_s=0)`` cuts that short.
        """
        linger = self.linger_s if linger_s is None else linger_s
        if linger <= 0:
            self._stop_now.set()
        elif self._server is not None:
            logger.info("dscale metrics: serving %s for %.0f s more", self.url, linger)
            self._lingering.set()
            self._stop_now.wait(linger)
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            _server.shutdown(*server)

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        # After an error there is nothing worth lingering for.
        self.stop(linger_s=0 if exc_type is not None else None)


def default_job_name() -> str:
    """The run's name: ``DSCALE_JOB_NAME`` (dscale-launch sets it), else the script's name.

    Not ``TORCHELASTIC_RUN_ID``: torchrun's rendezvous id is a fresh random id per launch under
    ``--standalone`` (and ``none`` otherwise), so every rerun of one job got a new series.
    ``torchrun train.py`` gives ``train``; an interactive session gives ``dscale``.
    """
    name = os.environ.get("DSCALE_JOB_NAME")
    if name:
        return name
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    stem = script[: -len(".py")] if script.endswith(".py") else ""
    return stem if stem and stem != "__main__" else "dscale"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def _min_scale(scaler: Any) -> float | None:
    try:
        value = scaler.state_dict().get("min_scale")
    except Exception:  # an exporter must never break the run it observes
        logger.debug("dscale metrics: scaler has no readable min_scale", exc_info=True)
        return None
    return None if value is None else float(value)


def _build_info() -> dict[str, str]:
    return {"version": dscale.__version__, "torch": torch.__version__.split("+")[0]}


def _check_exporter_args(
    port: Any, linger_s: float, certfile: str | None, keyfile: str | None
) -> None:
    """ValueError naming the bad argument of :func:`start_exporter`, before anything starts."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}; e.g. port={DEFAULT_PORT}")
    if linger_s < 0:
        raise ValueError(f"linger_s must be >= 0, got {linger_s!r}; 0 stops serving at once")
    if (certfile is None) != (keyfile is None):
        raise ValueError(
            f"certfile and keyfile go together, got certfile={certfile!r}, keyfile={keyfile!r}; "
            "pass both for HTTPS or neither for HTTP"
        )


def _labels(
    rank: int, local_rank: int, node: str | None, job_name: str | None, attempt: int | None
) -> dict[str, str]:
    """The labels every series of this rank carries."""
    labels = {
        "rank": str(rank),
        "local_rank": str(local_rank),
        "node": node or socket.gethostname(),
        "job_name": job_name or default_job_name(),
    }
    if attempt is not None:
        labels["attempt"] = str(attempt)
    return labels


def _register(
    scaler: Any,
    stats: NumericsStats | None,
    labels: dict[str, str],
    training: TrainingFigures | None,
    check_agreement_every: int,
    registry: CollectorRegistry | None,
) -> tuple[CollectorRegistry, ScalerCollector, RankScaleCheck | None]:
    """The collectors registered for one rank (and the rank check, an observer of the scaler)."""
    rank_check = None
    if check_agreement_every:
        rank_check = RankScaleCheck(check_agreement_every)
        scaler.add_observer(rank_check)
    collector = ScalerCollector(
        scaler,
        stats,
        labels=labels,
        min_scale=_min_scale(scaler),
        rank_check=rank_check,
        build_info=_build_info(),
        training=training,
    )
    registry = CollectorRegistry(auto_describe=False) if registry is None else registry
    registry.register(collector)
    # FP8 numerics (dscale_fp8_*) of a Float8Numerics made on this scaler, whenever it is made.
    registry.register(AttachedFloat8Collector(scaler, labels))
    # Shadow numerics (dscale_shadow_*) of a dscale.precision.ShadowNumerics on this scaler.
    registry.register(AttachedShadowCollector(scaler, labels))
    return registry, collector, rank_check


def start_exporter(
    scaler: Any,
    stats: NumericsStats | None = None,
    *,
    addr: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    rank: int | None = None,
    local_rank: int | None = None,
    node: str | None = None,
    job_name: str | None = None,
    attempt: int | None = None,
    training: TrainingFigures | None = None,
    linger_s: float = 30.0,
    check_agreement_every: int = 100,
    certfile: str | None = None,
    keyfile: str | None = None,
    registry: CollectorRegistry | None = None,
) -> MetricsExporter:
    """Serve this rank's scale metrics on ``addr:port + local_rank`` until ``stop()``.

    Every rank calls it. Values are read at scrape time, so the training loop pays nothing between
    scrapes. A busy port logs a warning and the run goes on without this rank's endpoint.

    Args:
        scaler: the ``dscale.GradScaler``.
        stats: optional ``NumericsStats`` attached to the scaler (grad norms, underflow, non-finite
            grads by parameter).
        addr: listen address; use "0.0.0.0" (or the pod IP) for a cluster Prometheus.
        port: base port; each rank adds its ``local_rank``. 0 picks any free port (tests).
        rank, local_rank: default to torchrun's ``RANK``/``LOCAL_RANK`` (else 0).
        node: ``node`` label, default the host name.
        job_name: ``job_name`` label (not ``job``, which Prometheus overwrites), default the
            run's name: ``DSCALE_JOB_NAME`` (set by dscale-launch to ``hydra.job.name``), else
            the script's file name without ``.py``, else "dscale". Give the run's name, stable
            across restarts and reruns, so that one run is one series in Prometheus.
        attempt: an ``attempt`` label (how many times the job was restarted or rerun), so the
            attempts of one run stay apart under the same ``job_name``; none when None.
        training: the loop's loss, learning rate, tokens/s, step time and step
            (``dscale_train_*``), served as the loop last reported them.
        linger_s: how long ``stop()`` keeps serving so the last values are scraped; make it at
            least one scrape interval (plus about 6 s for a file_sd target to be picked up).
        check_agreement_every: compare the scale across ranks every this many steps, at the
            next update whose collective carries the scale range (one in 16; a host read of two
            numbers each time; the values ride on the scaler's own collective, so no rank waits
            for another and ranks may differ here); 0 turns it off.
        certfile, keyfile: serve HTTPS with this certificate.
        registry: register into this registry (default: a new one holding only dscale's metrics).

    A ``dscale.fp8.Float8Numerics`` (and ``Float8Fallback``) made on ``scaler`` is served too
    (``dscale_fp8_*``, with these labels), whether made before or after this call.

    Example::

        stats = track_numerics(scaler, model)
        with start_exporter(scaler, stats, port=19400, linger_s=30):
            train()
    """
    _check_exporter_args(port, linger_s, certfile, keyfile)
    rank = _env_int("RANK", 0) if rank is None else rank
    local_rank = _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank
    if port and port + local_rank > 65535:
        raise ValueError(
            f"port={port} + local_rank={local_rank} is past 65535; pick a lower base port"
        )
    labels = _labels(rank, local_rank, node, job_name, attempt)
    registry, collector, rank_check = _register(
        scaler, stats, labels, training, check_agreement_every, registry
    )
    bind_port = port + local_rank if port else 0
    server = _server.serve(addr, bind_port, registry, certfile=certfile, keyfile=keyfile)
    bound = None if server is None else int(server[0].server_address[1])
    if bound is not None:
        logger.info("dscale metrics: rank %s serving on %s:%d/metrics", rank, addr, bound)
    return MetricsExporter(
        registry, collector, server, rank_check, addr=addr, port=bound, linger_s=linger_s
    )
