"""Keys with a fixed set of values: which they are, and one check that names the nearest value.

Both kinds are read from ``launch/schema.py``: Enum fields (Hydra refuses another value while
composing; ``launch/typos.py`` words that refusal with :func:`not_one_of`) and str or list[str]
fields declared with ``metadata=choices(...)`` (checked here, before any worker starts); besides
them ``model.name``, ``data.name`` (the group's options) and ``launcher.nproc_per_node``'s words.
The message names the key, the value typed and the nearest valid one:
``fp8.recipe=tensorwis is not one of tensorwise, rowwise, mxfp8, mxfp8_wgrad_with_hp; did you
mean fp8.recipe=tensorwise?``
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from enum import Enum
from typing import Any

from launch.schema import DataConfig, JobConfig, ModelConfig

# What a key accepts besides its listed values.
_ALSO = {"launcher.nproc_per_node": "a positive integer"}
# The groups whose node says which option was picked (``model=mlp`` sets ``model.name``).
_GROUPS = {"model": ModelConfig, "data": DataConfig}


def _canonical(key: str, value: str) -> str:
    if key == "checkpoint.save_on_signals":  # the library's spelling: any case, SIG optional
        name = value.upper()
        return name if name.startswith("SIG") else f"SIG{name}"
    if key == "fp8.emulate":  # Hydra reads true/false as booleans, which the str field spells True
        return value.lower()
    return value


def _listed(values: tuple[str, ...]) -> str:
    return ", ".join(values) if len(values) <= 8 else f"{', '.join(values[:8])}, ..."


def _accepted_besides(key: str, value: str) -> bool:
    return key == "launcher.nproc_per_node" and value.isdigit() and int(value) > 0


def choice_keys() -> dict[str, tuple[str, ...]]:
    """Every key of the schema with a fixed set of values, and those values (in order)."""
    found: dict[str, tuple[str, ...]] = {}
    _walk(JobConfig, "", found)
    for group, base in _GROUPS.items():
        found[f"{group}.name"] = tuple(dict.fromkeys(map(_picked, _subclasses(base))))
    found["launcher.nproc_per_node"] = ("auto", "cpu", "gpu")
    return found


def _picked(schema: type) -> str:
    """The ``name`` a group option's schema sets (``model=mlp``: MLPConfig's "mlp")."""
    return str(next(f.default for f in dataclasses.fields(schema) if f.name == "name"))


def _subclasses(base: type) -> list[type]:
    out: list[type] = []
    direct: list[type] = base.__subclasses__()
    for sub in direct:
        out += [sub, *_subclasses(sub)]
    return out


def _walk(schema: type, prefix: str, found: dict[str, tuple[str, ...]]) -> None:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if "choices" in f.metadata:
            found[prefix + f.name] = tuple(f.metadata["choices"])
        elif isinstance(kind, type) and issubclass(kind, Enum):
            found[prefix + f.name] = tuple(str(m.value) for m in kind)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            _walk(kind, f"{prefix}{f.name}.", found)


def nearest(value: str, values: tuple[str, ...]) -> str:
    """The valid value closest to ``value`` (by difflib's ratio, case ignored)."""
    low = value.lower()
    return max(values, key=lambda v: difflib.SequenceMatcher(None, low, v.lower()).ratio())


def not_one_of(key: str, value: Any, values: tuple[str, ...], *, element: bool = False) -> str:
    """``KEY=VALUE is not one of A, B; did you mean KEY=A?`` (``KEY has VALUE, ...`` for a
    list's element)."""
    also = f" or {_ALSO[key]}" if key in _ALSO else ""
    best = nearest(str(value), values)
    if element:
        return (
            f"{key} has {value}, which is not one of {_listed(values)}{also}; did you mean {best}?"
        )
    return f"{key}={value} is not one of {_listed(values)}{also}; did you mean {key}={best}?"


def _value(job: JobConfig, key: str) -> Any:
    node: Any = job
    for part in key.split("."):
        node = getattr(node, part)
    return node


def bad_choice(job: JobConfig) -> str | None:
    """The first key of ``job`` whose value is outside its set, in words; None if none is."""
    for key, values in choice_keys().items():
        value = _value(job, key)
        if isinstance(value, Enum):  # Hydra checked it while composing
            continue
        if isinstance(value, list):
            for item in value:
                if _canonical(key, str(item)) not in values:
                    return not_one_of(key, item, values, element=True)
            continue
        text = str(value)
        if _canonical(key, text) not in values and not _accepted_besides(key, text):
            return not_one_of(key, text, values)
        group, _, leaf = key.partition(".")
        if group in _GROUPS and leaf == "name":
            picked = _picked(type(_value(job, group)))
            if text != picked:
                return (
                    f"{key}={text} does not match the {group} picked ({group}={picked}): a "
                    f"{group} is picked by its group, {group}={text} (the node then has that "
                    f"{group}'s keys), not by {key}"
                )
    return None
