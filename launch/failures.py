"""Name the rank whose failure ended the job, and its cause, from torchelastic's error files.

torchelastic reports the failure it noticed first, by whole seconds. When one rank raises, its
peers fail a moment later in their next collective ("Connection closed by peer"), and the agent
often notices a peer first. Every rank that raised wrote ``attempt_N/<local rank>/error.json``;
the oldest of those files is the cause.
"""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def _first_line(message: Any) -> str:
    if isinstance(message, dict):  # {"message": "Type: text", "extraInfo": {...}}
        message = message.get("message", "")
    text = str(message).strip()
    return text.splitlines()[0] if text else ""


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$', re.M)
# Frames under these folders are not the user's: the launcher, the library, torch, the stdlib.
_NOT_USER = tuple(
    str(p)
    for p in {
        Path(__file__).resolve().parent,  # launch/
        Path(__file__).resolve().parent.parent / "dscale",
        *(Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "purelib", "platlib")),
    }
)


def user_frame(message: Any) -> str | None:
    """``file:line in function`` of the innermost frame of the user's own code, from error.json."""
    if not isinstance(message, dict):
        return None
    stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
    for m in reversed(list(_FRAME.finditer(stack))):
        path = str(Path(m["file"]).resolve())
        if not path.startswith(_NOT_USER) and not m["file"].startswith("<"):
            return f"{m['file']}:{m['line']} in {m['func'].strip()}"
    return None


def _error_files(exc: ChildFailedError) -> dict[int, tuple[int, str, Path]]:
    """``{global rank: (written at, ns; first line; path)}`` for this attempt's error files."""
    found: dict[int, tuple[int, str, Path]] = {}
    for rank, failure in exc.failures.items():
        path = Path(failure.error_file)
        if not path.is_file():
            continue
        first_global = rank - failure.local_rank  # this node's local rank 0
        for sibling in path.parent.parent.glob("*/error.json"):
            if not sibling.parent.name.isdigit():
                continue
            try:
                written = sibling.stat().st_mtime_ns
                data = json.loads(sibling.read_text())
            except (OSError, ValueError):
                continue
            message = _first_line(data.get("message", ""))
            frame = user_frame(data.get("message"))
            if frame:
                message += f"\n  at {frame}"
            found[first_global + int(sibling.parent.name)] = (written, message, sibling)
    return found


# What a rank raises when a peer it was in a collective with went away: a consequence, not a cause.
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|"
    r"DistBackendError|NCCL communicator was aborted|ProcessGroup\w* .*(aborted|timed out)|"
    r"Timed out waiting|Socket Timeout|gloo.*(closed|timed out|Timeout)",
    re.I,
)


def _peer_line(rank: int, said: str) -> str:
    first = said.splitlines()[0][:200] if said else ""
    if _LOST_PEER.search(said):
        return f"  rank {rank}: a consequence (its collective lost the failed rank): {first}"
    return f"  then rank {rank}: {first}"


def explain_failure(exc: ChildFailedError) -> str:
    """``rank R failed: Type: message`` and the user's line; then the other ranks, their
    collective errors marked as consequences."""
    errors = _error_files(exc)
    if errors:
        first_rank = min(errors, key=lambda r: errors[r][0])
        cause = errors[first_rank][1]
    else:
        first_rank, failure = exc.get_first_failure()
        cause = _first_line(failure.message) or f"exit code {failure.exitcode}"
    lines = [f"rank {first_rank} failed: {cause}"]
    for rank in sorted(set(errors) | set(exc.failures)):
        if rank == first_rank:
            continue
        said = errors[rank][1] if rank in errors else _first_line(exc.failures[rank].message)
        lines.append(_peer_line(rank, said))
    if first_rank in errors:
        lines.append(f"  rank {first_rank}'s traceback: {errors[first_rank][2]}")
    return "\n".join(lines)
