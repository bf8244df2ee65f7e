"""The deploy files pass their own tools: promtool, yamllint; the rest is checked structurally."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch
import yaml

import dscale
from dscale.metrics import start_exporter
from dscale.stats import track_numerics
from tests.deploy._tools import DEPLOY, PROMETHEUS_DIR
from tests.tools import require_tool, run_tool

pytestmark = pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss.s autograd graph")

RULES = PROMETHEUS_DIR / "rules" / "dscale.rules.yml"
FP8_RULES = PROMETHEUS_DIR / "rules" / "dscale-fp8.rules.yml"
SHIPPED_RULE_FILES = ["rules/dscale.rules.yml", "rules/dscale-fp8.rules.yml"]


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-file-sd.yml"])
def test_promtool_accepts_the_scrape_config(config: str) -> None:
    out = run_tool(require_tool("promtool"), "check", "config", config, cwd=PROMETHEUS_DIR)
    assert "SUCCESS: 2 rule files found" in out  # dscale's and the FP8 alerts
    assert yaml.safe_load((PROMETHEUS_DIR / config).read_text())["rule_files"] == SHIPPED_RULE_FILES


def test_promtool_accepts_the_rules() -> None:
    out = run_tool(require_tool("promtool"), "check", "rules", str(RULES))
    assert "SUCCESS: 7 rules found" in out


def test_the_alert_rules_pass_their_promtool_unit_tests() -> None:
    out = run_tool(
        require_tool("promtool"), "test", "rules", "dscale.rules_test.yml", cwd=RULES.parent
    )
    assert "SUCCESS" in out


def test_every_alert_has_a_severity_a_summary_and_a_description() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) == {
        "DScaleLossScaleCollapsed",
        "DScaleHighSkipRate",
        "DScaleRanksDisagree",
        "DScaleExporterDown",
        "DScaleStepsSkippedInARow",
        "DScaleSpikeSkipsInARow",
    }
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert {"summary", "description"} <= set(rule["annotations"]), name


def test_promtool_lints_the_real_exporter_output_clean() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dscale.GradScaler(device="cpu", init_scale=8.0, growth_interval=1, min_scale=1.0)
    stats = track_numerics(scaler, model, every=1)
    for poison in (False, True):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    with start_exporter(scaler, stats, port=0, linger_s=0) as exporter:
        assert exporter.url is not None
        with urllib.request.urlopen(exporter.url, timeout=30) as resp:
            text = resp.read().decode()
    assert 'dscale_nonfinite_grads_total{job_name="dscale"' in text
    run_tool(require_tool("promtool"), "check", "metrics", stdin=text)


def test_yamllint_accepts_every_deploy_yaml() -> None:
    files = sorted(str(p) for p in DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 6, files
    run_tool(require_tool("yamllint"), "--strict", "-c", str(DEPLOY / ".yamllint"), *files)


def test_the_kubernetes_scrape_config_keeps_only_dscale_metrics_ports() -> None:
    # Debian's promtool lacks kubernetes_sd_configs, so this file is checked by structure.
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus-k8s.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "dscale"
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    relabel = job["relabel_configs"]
    keeps = {r["source_labels"][0]: r["regex"] for r in relabel if r.get("action") == "keep"}
    assert keeps["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == "dscale"
    port_re = re.compile(f"^(?:{keeps['__meta_kubernetes_pod_container_port_name']})$")
    assert port_re.match("metrics-0") and port_re.match("metrics")
    assert not port_re.match("http")
    assert config["rule_files"] == SHIPPED_RULE_FILES
    # Everything but the discovery must be what promtool checked in prometheus.yml.
    static = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["global"] == static["global"]


def test_the_podmonitor_selects_dscale_pods_on_named_metrics_ports() -> None:
    pm = yaml.safe_load((DEPLOY / "kubernetes" / "podmonitor.yaml").read_text())
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "dscale"}
    ports = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
    assert ports == ["metrics-0", "metrics-1"]
    assert all(e["path"] == "/metrics" for e in pm["spec"]["podMetricsEndpoints"])


def test_the_prometheusrule_carries_exactly_the_tested_rules() -> None:
    wrapper = yaml.safe_load((DEPLOY / "kubernetes" / "prometheusrule.yaml").read_text())
    assert wrapper["apiVersion"] == "monitoring.coreos.com/v1"
    assert wrapper["kind"] == "PrometheusRule"
    groups = [g for f in (RULES, FP8_RULES) for g in yaml.safe_load(f.read_text())["groups"]]
    assert wrapper["spec"]["groups"] == groups


def test_the_file_sd_example_is_valid_target_groups() -> None:
    groups = json.loads((PROMETHEUS_DIR / "targets" / "example.json").read_text())
    for group in groups:
        assert set(group) == {"targets", "labels"}
        assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in group["targets"])


def test_the_grafana_dashboard_has_the_four_required_panels() -> None:
    dash = json.loads((DEPLOY / "grafana" / "dscale.json").read_text())
    exprs = {p["title"]: p["targets"][0]["expr"] for p in dash["panels"]}
    assert "dscale_loss_scale" in exprs["Loss scale per rank"]
    assert "dscale_optimizer_steps_skipped_total" in exprs["Skip rate"]
    assert "dscale_grad_norm" in exprs["Grad norm (unscaled)"]
    assert "by (param)" in exprs["Non-finite grads by parameter (over the range)"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "job_name"}


def test_the_dashboard_shows_every_training_figure_the_exporter_serves() -> None:
    from dscale.metrics._training import HELP  # the dscale_train_* gauges and their help

    dash = json.loads((DEPLOY / "grafana" / "dscale.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    missing = [
        name for name in HELP if not any(f'{name}{{job_name=~"$job_name"}}' in e for e in exprs)
    ]
    assert not missing, f"no dashboard panel queries {missing}"


def test_the_dashboard_shows_the_fp8_numerics_per_layer() -> None:
    from dscale.fp8._collector import SHARES  # the dscale_fp8_*_ratio gauges the exporter serves

    dash = json.loads((DEPLOY / "grafana" / "dscale.json").read_text())
    by_expr = {t["expr"]: (p, t) for p in dash["panels"] for t in p["targets"]}
    for share in SHARES:
        expr = f'max by (layer, tensor) (dscale_fp8_{share}_ratio{{job_name=~"$job_name"}})'
        panel, target = by_expr[expr]  # one series per layer and tensor, the worst rank's
        assert "{{layer}}" in target["legendFormat"] and "{{tensor}}" in target["legendFormat"]
        assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert 'max by (layer) (dscale_fp8_fallback{job_name=~"$job_name"})' in by_expr
    grid = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dash["panels"]]
    assert len(grid) == len(set(grid))  # no panel drawn over another


def test_the_dashboard_shows_every_recipe_field_per_layer() -> None:
    """Every recipe's own field the FP8 collector serves (rowwise, MXFP8, NVFP4) has a panel
    with one series per layer and tensor, the worst rank's; the gradient-flush heatmap (the
    all-zero-gradients failure) selects grad_output."""
    from dscale.fp8._collector import OWN_FIELDS

    dash = json.loads((DEPLOY / "grafana" / "dscale.json").read_text())
    by_expr = {t["expr"]: (p, t) for p in dash["panels"] for t in p["targets"]}
    for metric, _ in OWN_FIELDS.values():
        expr = f'max by (layer, tensor) (dscale_fp8_{metric}{{job_name=~"$job_name"}})'
        panel, target = by_expr[expr]
        assert "{{layer}}" in target["legendFormat"] and "{{tensor}}" in target["legendFormat"]
        want = "percentunit" if metric.endswith("_ratio") else "none"
        assert panel["fieldConfig"]["defaults"]["unit"] == want, metric
    grads = 'dscale_fp8_flushed_ratio{job_name=~"$job_name",tensor="grad_output"}'
    assert by_expr[f"max by (layer, tensor) ({grads})"][0]["type"] == "status-history"
