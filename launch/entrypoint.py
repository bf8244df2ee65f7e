"""Find the user's function from ``entrypoint=module:function``, with errors that say why not."""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class EntrypointError(ValueError):
    """The entrypoint cannot be imported or called; the message names it and the cause."""


def check_spec(spec: str) -> tuple[str, str]:
    """Split ``module:function``; raise EntrypointError for anything else."""
    if not _SPEC.match(spec):
        raise EntrypointError(
            f"entrypoint={spec!r} is not MODULE:FUNCTION; e.g. entrypoint=my_pkg.train:main "
            "(the module is imported on every rank and the function called with the context)"
        )
    module, _, name = spec.partition(":")
    return module, name


def load_entrypoint(spec: str) -> Callable[[Any], Any]:
    """Import ``module`` and return its ``function`` (dots walk attributes: ``mod:Class.fn``).

    The module is found as ``python -m`` would find it: the folder the launcher was started
    from, ``PYTHONPATH``, or an installed package.
    """
    module_name, name = check_spec(spec)
    # `python -m launch` has the current folder on sys.path; the dscale-launch console script
    # has its bin folder there instead, so the check before the workers start put it in too.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntrypointError(
            f"entrypoint={spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
            "run dscale-launch from the folder that holds the package, add it to PYTHONPATH, "
            "or pip install it"
        ) from exc
    for part in name.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            raise EntrypointError(
                f"entrypoint={spec!r}: {module_name!r} has no attribute {name!r} "
                f"(it has: {shown or 'nothing public'})"
            )
        target = getattr(target, part)
    if not callable(target):
        raise EntrypointError(
            f"entrypoint={spec!r} is not callable (it is the {type(target).__name__} "
            f"{target!r:.60}); point it at a function that takes the run context, "
            "e.g. def main(ctx): ..."
        )
    function: Callable[[Any], Any] = target
    return function
