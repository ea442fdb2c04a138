"""A real Prometheus scraping the services of ``seawall up``, with seawall's rules
loaded: the documented series come with the documented labels, the recording rules
produce them, one alerting rule fires when its condition is provoked (a garbage record
on the ingress topic is dead-lettered: ``SeawallDeadLetters``), and every panel of the
Grafana dashboards is a query this Prometheus runs without error."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from seawall.embedded import free_port
from services.common.bus import topics_of
from tests.fleet import produce
from tests.observability.conftest import DEPLOY, tool
from tests.stack import Stack, launch

pytestmark = [pytest.mark.e2e]

RULES = DEPLOY / "prometheus" / "seawall.rules.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))


def targets(stack: Stack) -> dict[str, int]:
    """Each service instance of the stack and the port of its ``/metrics``."""
    found: dict[str, int] = {}
    for child in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "SEAWALL_METRICS_PORT" in env and "SEAWALL_INSTANCE_ID" in env:
            found[env["SEAWALL_INSTANCE_ID"]] = int(env["SEAWALL_METRICS_PORT"])
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    with launch(
        tmp_path_factory.mktemp("stack"), redis_url, "--workers", "1", "--small-workers", "0"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus scraping every service each second, seawall's rules evaluated each
    second (the file's own 30 s group interval, shortened for the test)."""
    binary = tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    rules = work / "seawall.rules.yml"
    rules.write_text(RULES.read_text().replace("interval: 30s", "interval: 1s"))
    scrape = [
        {
            "job_name": instance,
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            "relabel_configs": [{"target_label": "instance", "replacement": instance}],
        }
        for instance, port in sorted(targets(stack).items())
    ]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": scrape,
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (work / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def eventually(url: str, expr: str, timeout_s: float = 90, n: int = 1) -> list[dict[str, Any]]:
    """The result of ``expr`` once it holds at least ``n`` series."""
    deadline = time.monotonic() + timeout_s
    while len(result := query(url, expr)) < n:
        assert time.monotonic() < deadline, f"{result} for {expr} after {timeout_s} s"
        time.sleep(1)
    return result


def traffic(stack: Stack) -> None:
    """A few requests of each tier, some refused (a basic tenant over its bucket)."""
    with httpx.Client(timeout=90) as client:
        for tier, n in (("enterprise", 3), ("pro", 3), ("basic", 25)):
            key = stack.key(f"obs-{tier}", tier)["key"]
            for _ in range(n):
                client.post(
                    f"{stack.url}/v1/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "default", "prompt": "hi", "max_tokens": 4},
                )


def test_prometheus_scrapes_the_documented_series_and_rules(stack: Stack, prometheus: str) -> None:
    expected = targets(stack)
    up = eventually(prometheus, "up == 1", n=len(expected))
    assert {s["metric"]["instance"] for s in up} == set(expected)
    assert set(expected) >= {
        "ingress",
        "admission",
        "controller",
        "worker-main",
        "worker-dedicated",
    }
    traffic(stack)
    for expr, labels in [
        ('seawall_worker_request_duration_seconds_bucket{pool="main"}', {"pool", "priority", "le"}),
        ("seawall_worker_time_to_first_token_seconds_bucket", {"pool", "priority", "le"}),
        ('seawall_worker_requests_total{status="ok"}', {"pool", "priority", "status"}),
        ("seawall_admission_decisions_total", {"outcome", "reason", "priority", "tier"}),
        ('seawall_admission_decisions_total{outcome="rejected", tier="basic"}', {"reason"}),
        ("seawall_admission_tenant_decisions_total", {"tenant", "tier", "outcome"}),
        ('seawall_engine_kv_cache_usage_ratio{pool="main"}', {"pool"}),
        ("seawall_gpu_temperature_celsius", {"pool", "gpu"}),
        ("seawall_consumer_lag_records", {"loop", "topic", "partition"}),
        ('seawall_controller_breaker_state{scope="pool:main"}', {"scope"}),
        ("seawall_control_state_age_seconds", set()),
        ('seawall:goodput_requests:rate5m_by_pool{pool="main-dedicated"}', {"pool"}),
        ("seawall:goodput_requests:rate5m_by_pool_priority", {"pool", "priority"}),
        ('seawall:request_duration_seconds:p99_by_pool_priority{pool="main"}', {"priority"}),
        ('seawall:admission_rejections:rate5m_by_tier{tier="basic"}', {"tier"}),
    ]:
        series = eventually(prometheus, expr)
        assert labels <= set(series[0]["metric"]), (expr, series[0]["metric"])


def test_an_alerting_rule_fires_when_provoked(stack: Stack, prometheus: str) -> None:
    assert query(prometheus, 'ALERTS{alertname="SeawallDeadLetters"}') == []
    asyncio.run(produce(stack.settings, topics_of(stack.settings).ingress, [b"\x00 not json"]))
    (alert,) = eventually(prometheus, 'ALERTS{alertname="SeawallDeadLetters", alertstate="firing"}')
    assert (alert["metric"]["service"], alert["metric"]["severity"]) == ("ingress", "warning")


METRIC_NAME = re.compile(r"\b(seawall[_:][A-Za-z0-9_:]+)")


def known_to_prometheus(url: str, name: str, rules: dict[str, str]) -> bool:
    """Whether ``name`` is a metric some target exposes (its metadata was scraped, with
    samples or not yet) or a recording rule whose own inputs all are."""
    if name in rules:
        return all(known_to_prometheus(url, n, rules) for n in METRIC_NAME.findall(rules[name]))
    base = re.sub(r"_(bucket|sum|count|total)$", "", name)
    r = httpx.get(f"{url}/api/v1/metadata", params={"metric": name}, timeout=10)
    r_base = httpx.get(f"{url}/api/v1/metadata", params={"metric": base}, timeout=10)
    return bool(r.json()["data"]) or bool(r_base.json()["data"])


def recording_rules(url: str) -> dict[str, str]:
    groups = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    return {r["name"]: r["query"] for g in groups for r in g["rules"] if r["type"] == "recording"}


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_every_dashboard_panel_shows_data_from_a_running_stack(
    dashboard: Path, stack: Stack, prometheus: str
) -> None:
    """Each panel's query returns at least one series once the stack has served a
    little traffic: a misspelt metric or label returns nothing. A panel of events that
    this traffic does not cause (a controller alert, a dead letter, a shadow run that
    disagreed) may be empty, but every metric and recording rule it reads must exist:
    scraped from a service (its metadata is known before any sample) or recorded from
    metrics that are. ``EVENT_PANELS`` names them, so that no other panel goes empty
    unnoticed."""
    traffic(stack)
    doc = json.loads(dashboard.read_text())
    targets = [(p["title"], t["expr"]) for p in doc["panels"] for t in p["targets"]]
    assert len(targets) >= 4
    rules = recording_rules(prometheus)
    for title, expr in targets:
        expr = expr.replace("$tenant", "obs-basic")
        if title not in EVENT_PANELS:
            eventually(prometheus, expr, timeout_s=60)
        elif not query(prometheus, expr):
            names = METRIC_NAME.findall(expr)
            assert names, expr
            unknown = [n for n in names if not known_to_prometheus(prometheus, n, rules)]
            assert unknown == [], (title, unknown)
    if dashboard.stem == "seawall-fleet":  # where they are: a renamed one is caught
        assert {title for title, _ in targets} >= EVENT_PANELS


EVENT_PANELS = {
    "Controller alerts firing",
    "Dead letters per second by service and reason",
    "Output mismatch ratio by pool (shadow runs)",
}
"""Panels of events the test's traffic does not cause (the others must show data)."""
