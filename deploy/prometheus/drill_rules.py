"""Write a copy of dscale's alert rules with every duration shortened, for alert drills and tests.

The shipped rules wait minutes before firing (``for: 10m``) and look back ten minutes
(``rate(...[10m])``). To check the whole alert path (exporter -> Prometheus -> Alertmanager ->
receiver) in a minute instead of an hour, load a copy in which every ``for:`` and every range
selector is multiplied by ``--factor``; the shipped file stays as it is.

    python deploy/prometheus/drill_rules.py --factor 0.01 \\
        deploy/prometheus/rules/dscale.rules.yml /tmp/dscale.drill.rules.yml

then point a Prometheus' ``rule_files`` at the copy (see deploy/README.md, "Alert drill").
``tests/deploy/test_alerts.py`` runs every alert this way against a real job.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import yaml

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
_RANGE = re.compile(r"\[(\d+(?:ms|s|m|h|d))\]")


def scale_duration(duration: str, factor: float) -> str:
    """``"10m"`` times 0.01 is ``"6000ms"``; never below one millisecond."""
    match = _DURATION.fullmatch(duration)
    if match is None:
        raise ValueError(f"not a simple Prometheus duration: {duration!r} (e.g. 10m)")
    ms = int(match.group(1)) * _UNIT_MS[match.group(2)]
    return f"{max(1, round(ms * factor))}ms"


def drill_rules(rules: dict[str, Any], factor: float) -> dict[str, Any]:
    """The rules with every ``for:`` and ``[range]`` multiplied by ``factor``; names unchanged."""
    if not 0 < factor <= 1:
        raise ValueError(f"factor must be in (0, 1], got {factor!r}; e.g. 0.01 for 10m -> 6s")
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["expr"] = _RANGE.sub(
                lambda m: f"[{scale_duration(m.group(1), factor)}]", rule["expr"]
            )
            if "for" in rule:
                rule["for"] = scale_duration(rule["for"], factor)
    return rules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factor", type=float, required=True, help="e.g. 0.01: 10m -> 6s")
    parser.add_argument("rules", type=Path, help="deploy/prometheus/rules/dscale.rules.yml")
    parser.add_argument("out", type=Path, help="where to write the shortened copy")
    args = parser.parse_args()
    rules = drill_rules(yaml.safe_load(args.rules.read_text()), args.factor)
    args.out.write_text(yaml.safe_dump(rules, sort_keys=False))


if __name__ == "__main__":
    main()
