"""Did-you-mean for a mistyped key on the command line, before Hydra's own advice.

Hydra refuses ``trainer.max_stepz=10`` with "To append to your config use +trainer.max_stepz=10",
which only leads to the launcher's refusal of an unknown key, and ``trainer.precision=fp4`` with
the choices but not the nearest one. Before Hydra runs, the overrides are composed once here;
when a key is missing from its config node and a key of that node is close to it, the launcher
names that key instead, and a value outside an Enum's choices is named with the nearest one
(``launch/choices.py``'s words), as is a group option that is not there (``parallel=dpp``: Hydra's
own message lists the options, an internal schema node among them, and names no fix). Anything
else is left to Hydra's messages.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from launch.choices import choice_keys, not_one_of

# Flags that change which configs are read; with them, Hydra's own message stands.
OTHER_CONFIGS = ("--config-dir", "-cd", "--config-path", "-cp")
_REFUSED = re.compile(r"Could not override '([^']+)'")
_NOT_FOUND = re.compile(r"Could not find '([\w.-]+)/([^'/]+)'")


def primary_name(argv: Sequence[str], default: str) -> str:
    for i, arg in enumerate(argv):
        if arg in ("--config-name", "-cn") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config-name="):
            return arg.split("=", 1)[1]
    return default


def misspelt_key(argv: Sequence[str], config_dir: str, config_name: str) -> str | None:
    """``K is not a config key; did you mean L?`` for the first override Hydra would refuse."""
    if any(a.split("=", 1)[0] in OTHER_CONFIGS for a in argv):
        return None
    lines = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception:  # Hydra reports a malformed override in its own words
        return None
    # hydra.* keys configure Hydra itself, which compose() does not take on the command line;
    # a multirun sweep (``-m key=a,b``) is composed with its first value.
    try:
        keys = {
            (
                f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
                if o.is_sweep_override()
                else str(o.input_line)
            ): o.key_or_group
            for o in parsed
            if not o.key_or_group.startswith("hydra.")
        }
    except Exception:  # a sweep only Hydra's sweeper expands (glob(*) reads the config groups)
        return None
    overrides = list(keys)
    changed = {o.key_or_group for o in parsed if o.type == OverrideType.CHANGE}
    if GlobalHydra.instance().is_initialized():  # a caller's own Hydra session: not ours to end
        return None
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        name = primary_name(argv, config_name)
        try:
            compose(name, overrides=overrides)
            return None
        except Exception as exc:
            choice = outside_an_enum(exc) or _missing_option(exc, config_dir)
            if choice:
                return choice
            found = _REFUSED.search(str(exc))
        key = found.group(1) if found else None
        if key is None or key not in changed:
            return None
        try:
            cfg = compose(name, overrides=[o for o in overrides if keys[o] != key])
        except Exception:
            return None
    parent, dot, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf in node:
        return None
    close = difflib.get_close_matches(leaf, [str(k) for k in node], n=1)
    if not close:
        return None
    return f"{key} is not a config key; did you mean {parent}{dot}{close[0]}?"


def outside_an_enum(exc: Exception) -> str | None:
    """Hydra's refusal of a value outside an Enum field's choices, in launch/choices.py's words
    (the nearest value named); None for any other error."""
    cause = exc.__cause__
    if not isinstance(cause, ValidationError):
        return None
    key, value = getattr(cause, "full_key", None), getattr(cause, "value", None)
    values = choice_keys().get(str(key))
    if values is None or value is None or str(value) in values:
        return None
    return not_one_of(str(key), value, values)


def _missing_option(exc: Exception, config_dir: str) -> str | None:
    """``parallel=dpp is not one of ddp, fsdp, single; did you mean parallel=ddp?`` for a group
    option that is not among the group's YAML files (its schema node ``base_*`` is not one to
    pick); None for any other error or a group from elsewhere on the search path."""
    found = _NOT_FOUND.search(str(exc))
    if found is None:
        return None
    group, value = found.groups()
    folder = Path(config_dir) / group
    options = tuple(sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("base_")))
    if not options or value in options:
        return None
    return not_one_of(group.replace("/", "."), value, options)
