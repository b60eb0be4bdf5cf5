"""The real monitoring stack: Debian's promtool checks the shipped scrape config and alert rules and
runs their unit tests (every alert fires on a bad series and stays silent on a clean one); a real
Prometheus on loopback scrapes a running `graph-inspector serve` with the shipped scrape config and
holds the same numbers as /api/summary."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.daemon import Daemon, terminate

pytestmark = pytest.mark.prometheus

GRAFANA = Path(__file__).resolve().parents[2] / "dashboard" / "grafana"
TOKEN = "prometheus-scrape-t0k"
SCRAPE_TIMEOUT = 60.0


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"Debian's {name} is not installed (scripts/setup --dev installs the prometheus package)")
    return found


def promtool(*args: str | Path, cwd: Path = GRAFANA) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load((GRAFANA / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def unit_tests() -> dict[str, Any]:
    return yaml.safe_load((GRAFANA / "alerts.test.yml").read_text())


def test_the_shipped_scrape_config_and_rules_pass_promtool() -> None:
    config = promtool("check", "config", "--syntax-only", "prometheus-scrape.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_every_alert_has_a_unit_test_that_fires_and_one_that_stays_silent() -> None:
    suite = unit_tests()
    assert suite["rule_files"] == ["alerts.yml"]
    cases = [case for test in suite["tests"] for case in test["alert_rule_test"]]
    for alert in (rule["alert"] for rule in rules()):
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == alert]
        assert any(expected), f"{alert}: no unit test in which it fires"
        assert [] in expected, f"{alert}: no unit test in which it stays silent"


def test_the_alert_unit_tests_pass() -> None:
    ran = promtool("test", "rules", "alerts.test.yml")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "SUCCESS" in ran.stdout


@pytest.mark.parametrize("expr", ["vector(1) < 0", "vector(1)"], ids=["never-fires", "always-fires"])
def test_the_unit_tests_catch_an_alert_that_is_broken(expr: str, tmp_path: Path) -> None:
    shutil.copy(GRAFANA / "alerts.test.yml", tmp_path)
    broken = yaml.safe_load((GRAFANA / "alerts.yml").read_text())
    for group in broken["groups"]:
        for rule in group["rules"]:
            rule["expr"] = expr
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(broken))
    ran = promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    assert ran.returncode != 0
    for rule in rules():
        assert f"alertname: {rule['alert']}," in ran.stdout + ran.stderr, rule["alert"]


class Prometheus:
    """A Prometheus server on a free loopback port, with its own storage, stopped on exit."""

    def __init__(self, config: Path, storage: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{probe.getsockname()[1]}"
        self.log = storage.with_suffix(".log")
        self.command = [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={storage}",
                        f"--web.listen-address={self.address}", "--log.level=warn"]
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        terminate(self._process)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://{self.address}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def wait_for_a_scrape(self) -> dict[str, Any]:
        """The one target, once it has been scraped; fails with Prometheus's log after a minute."""
        deadline = time.monotonic() + SCRAPE_TIMEOUT
        last: Any = "Prometheus did not answer"
        while time.monotonic() < deadline:
            assert self._process is not None and self._process.poll() is None, self.log.read_text()
            try:
                targets = self.api("targets")["activeTargets"]
            except OSError as error:
                last = error
            else:
                last = targets
                if targets and targets[0]["health"] == "up":
                    return targets[0]
            time.sleep(0.5)
        log = self.log.read_text()
        raise AssertionError(f"no successful scrape in {SCRAPE_TIMEOUT:.0f} s: {last}\n{log}")

    def value(self, expr: str) -> float:
        [sample] = self.api("query", query=expr)["result"]
        return float(sample["value"][1])

    def values(self, expr: str, label: str) -> dict[str, float]:
        return {s["metric"][label]: float(s["value"][1]) for s in self.api("query", query=expr)["result"]}


@pytest.fixture
def served(db_url: str, seeded: dict[str, int]) -> Iterator[Daemon]:
    with Daemon(db_url, extra_args=["--token", TOKEN]) as daemon:
        yield daemon


def scrape_config_for(daemon: Daemon, tmp_path: Path) -> Path:
    """The shipped scrape config, pointed at ``daemon`` with its token, scraping every second."""
    token_file = tmp_path / "graph-inspector.token"
    token_file.write_text(TOKEN)
    config = yaml.safe_load((GRAFANA / "prometheus-scrape.yml").read_text())
    [job] = config["scrape_configs"]
    job["static_configs"] = [{"targets": [urllib.parse.urlsplit(daemon.url).netloc]}]
    job["authorization"]["credentials_file"] = str(token_file)
    job["scrape_interval"] = "1s"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def summary_of(daemon: Daemon) -> dict[str, Any]:
    request = urllib.request.Request(daemon.url + "api/summary", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"]


def test_a_real_prometheus_scrapes_the_daemon_and_agrees_with_the_summary(
    served: Daemon, tmp_path: Path
) -> None:
    config = scrape_config_for(served, tmp_path)
    checked = promtool("check", "config", config)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with Prometheus(config, tmp_path / "tsdb") as prometheus:
        target = prometheus.wait_for_a_scrape()
        assert target["labels"]["job"] == "graph-inspector" and target["scrapeUrl"].endswith("/metrics")
        summary = summary_of(served)
        traffic, graphs = summary["traffic"], summary["graphs"]
        assert prometheus.value('graph_inspector_database_up{job="graph-inspector"}') == 1
        assert prometheus.values("graph_inspector_captures_total", "mode") == graphs["by_mode"]
        assert prometheus.value("sum(graph_inspector_graph_pool_bytes)") == graphs["pool_bytes"]
        assert prometheus.value("sum(graph_inspector_replays_total)") == traffic["replays"]
        assert prometheus.value("sum(graph_inspector_eager_fallbacks_total)") == traffic["eager_batches"]
        assert prometheus.value("sum(graph_inspector_real_tokens_total)") == traffic["num_real_tokens"]
        assert prometheus.value("sum(graph_inspector_padding_tokens_total)") == traffic["padding_tokens"]
        assert prometheus.value("graph_inspector_replay_hit_ratio") == pytest.approx(traffic["hit_ratio"])
        waste = prometheus.value("graph_inspector_padding_waste_ratio")
        assert waste == pytest.approx(traffic["padding_waste"])
        assert prometheus.value("sum(graph_inspector_runs)") == summary["runs"]["total"]
        assert set(prometheus.values("graph_inspector_violations_total", "kind")) == set(
            summary["violations"]["by_kind"]
        )
