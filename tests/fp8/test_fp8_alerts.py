"""The FP8 alert rules pass promtool: check rules, and their unit tests (fire and stay quiet)."""

from __future__ import annotations

from tests.deploy._tools import PROMETHEUS_DIR
from tests.tools import require_tool, run_tool

RULES = PROMETHEUS_DIR / "rules"


def test_promtool_accepts_the_fp8_rules() -> None:
    out = run_tool(require_tool("promtool"), "check", "rules", str(RULES / "dscale-fp8.rules.yml"))
    assert "SUCCESS: 5 rules found" in out


def test_the_fp8_alerts_pass_their_promtool_unit_tests() -> None:
    out = run_tool(
        require_tool("promtool"), "test", "rules", "dscale-fp8.rules_test.yml", cwd=RULES
    )
    assert "SUCCESS" in out
