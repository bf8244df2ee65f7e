"""Per-rank HTTP server for /metrics; it never raises into training."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)


def serve(
    addr: str,
    port: int,
    registry: CollectorRegistry,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> tuple[WSGIServer, threading.Thread] | None:
    """Serve ``registry`` on ``addr:port`` from a daemon thread; None (and a warning) if it can't.

    A busy port or a bad certificate must not stop a training run, so both become a warning that
    says what is lost.
    """
    try:
        return start_http_server(
            port, addr=addr, registry=registry, certfile=certfile, keyfile=keyfile
        )
    except OSError as exc:
        logger.warning(
            "dscale metrics: cannot serve on %s:%d (%s); this rank's metrics will not be scraped, "
            "training goes on. Pick another base port (port=...) if it is in use",
            addr,
            port,
            exc,
        )
    return None


def shutdown(server: WSGIServer, thread: threading.Thread) -> None:
    """Stop serving and free the port."""
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)
