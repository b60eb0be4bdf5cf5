"""The shipped Grafana dashboard and Prometheus alert rules name only metrics the daemon exports,
carry units, read 0 when a series is empty, and cover the three alerts operators need."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from flask.testing import FlaskClient

from inspector.reading.metrics import METRICS

GRAFANA = Path(__file__).resolve().parents[2] / "dashboard" / "grafana"
METRIC_NAME = re.compile(r"\bgraph_inspector_[a-z_]+\b")
SUMMARY_SUFFIXES = ("_sum", "_count")


def dashboard() -> dict:
    return json.loads((GRAFANA / "graph-inspector.json").read_text())


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load((GRAFANA / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def named_metrics() -> set[str]:
    text = " ".join(dashboard_exprs() + [rule["expr"] for rule in rules()])
    return set(METRIC_NAME.findall(text))


def base_name(name: str) -> str:
    declared = {spec.name: spec for spec in METRICS}
    if name in declared:
        return name
    for suffix in SUMMARY_SUFFIXES:
        stem = name.removesuffix(suffix)
        if stem in declared and declared[stem].type == "summary":
            return stem
    raise AssertionError(f"{name} is not in inspector.reading.metrics.METRICS")


def test_every_named_metric_is_declared_by_the_collector() -> None:
    names = named_metrics()
    assert len(names) >= 12
    for name in names:
        base_name(name)


def test_every_named_metric_is_in_a_real_scrape(client: FlaskClient) -> None:
    scrape = client.get("/metrics").get_data(as_text=True)
    samples = [line for line in scrape.splitlines() if line and not line.startswith("#")]
    exported = {line.split("{")[0].split(" ")[0] for line in samples}
    missing = {name for name in named_metrics() if name not in exported}
    assert not missing, f"named by Grafana or the alerts but not exported: {sorted(missing)}"


def test_every_panel_has_a_unit_and_reads_zero_when_empty() -> None:
    panels = dashboard()["panels"]
    assert len(panels) >= 10
    for panel in panels:
        assert panel["fieldConfig"]["defaults"].get("unit"), f"panel {panel['title']!r} has no unit"
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].rstrip().endswith("or vector(0)"), target["expr"]
            assert 'job=~"$job"' in target["expr"]


def test_dashboard_asks_for_its_data_source() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


@pytest.mark.parametrize(
    ("alert", "metric"),
    [
        ("GraphInspectorViolationsIncreasing", "graph_inspector_violations_total"),
        ("GraphInspectorPaddingWasteHigh", "graph_inspector_padding_tokens_total"),
        ("GraphInspectorHitRatioFalling", "graph_inspector_eager_fallbacks_total"),
        ("GraphInspectorCompileRerecording", "graph_inspector_compile_events_total"),
    ],
)
def test_the_alerts_exist_and_explain_themselves(alert: str, metric: str) -> None:
    rule = next(r for r in rules() if r.get("alert") == alert)
    assert metric in rule["expr"]
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
