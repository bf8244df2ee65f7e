"""Free TCP ports on 127.0.0.1 for servers the tests start (exporters, Prometheus, rendezvous)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 a moment ago (one per local rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = int(a.getsockname()[1])
            if base >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")
