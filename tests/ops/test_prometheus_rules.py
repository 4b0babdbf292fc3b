"""ops/prometheus and ops/grafana: promtool checks and unit-tests the rules, every query of
the rules and the dashboard is valid PromQL over metrics the gateway exports, and the
Prometheus alert is the in-process one."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.observability.metrics import GatewayMetrics
from policies.alerts import ALERT_NAME, DEFAULT_FOR_S, DEFAULT_MIN_SAMPLES, DEFAULT_WINDOW_S
from tests.gateway.observability.test_metrics import populated_metrics

OPS = Path(__file__).resolve().parents[2] / "ops"
PROMETHEUS = OPS / "prometheus"
RULE_FILES = ("recording_rules.yml", "alert_rules.yml")
DASHBOARD = OPS / "grafana" / "tiergate-dashboard.json"
INSTALL = "apt-get install -y --no-install-recommends prometheus"


def _promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(f"promtool is not installed; Debian's prometheus package has it: {INSTALL}")
    result = subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _rules() -> list[dict[str, Any]]:
    rules = []
    for name in RULE_FILES:
        for group in yaml.safe_load((PROMETHEUS / name).read_text())["groups"]:
            rules.extend(group["rules"])
    return rules


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in _dashboard()["panels"] for target in panel["targets"]]


def test_promtool_checks_the_rules() -> None:
    out = _promtool("check", "rules", *RULE_FILES)
    assert out.count("SUCCESS") == len(RULE_FILES)


def test_promtool_unit_tests_pass() -> None:
    tests = sorted(str(p.relative_to(PROMETHEUS)) for p in (PROMETHEUS / "tests").glob("*.yml"))
    assert tests
    out = _promtool("test", "rules", *tests)
    assert out.count("SUCCESS") == len(tests)


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses rule expressions: each query becomes a recording rule of a scratch file.
    rules = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$tier", ".*")}
        for i, expr in enumerate(_dashboard_exprs())
    ]
    scratch = tmp_path / "dashboard_rules.yml"
    scratch.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in _promtool("check", "rules", str(scratch))


def _exported_names(metrics: GatewayMetrics) -> set[str]:
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_queries_use_only_exported_or_recorded_series() -> None:
    exported = _exported_names(populated_metrics())
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    exprs = [rule["expr"] for rule in _rules()] + _dashboard_exprs()
    used = {
        token
        for expr in exprs
        for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
        if "tiergate_" in token
    }
    assert used - exported - recorded == set()
    assert recorded <= used  # every recorded series is read by the alert or the dashboard


def test_dashboard_shows_what_operators_need() -> None:
    panels = {panel["title"]: panel for panel in _dashboard()["panels"]}
    exprs = {title: " ".join(t["expr"] for t in p["targets"]) for title, p in panels.items()}
    ttft = exprs["TTFT p99 and p50 per tier, against the SLO"]
    for series in ("p99_5m", "p50_5m", "tiergate_ttft_slo_seconds"):
        assert series in ttft
    assert "completion_tokens" in exprs["Throughput"]
    assert "tiergate_kv_blocks_used" in exprs["KV cache usage per tier"]
    assert "tiergate_requests_waiting" in exprs["Queue depth"]
    assert "reason" in exprs["429s by reason"]
    assert "tenant:tiergate_gpu_seconds" in exprs["GPU-seconds per tenant"]
    process = exprs["Event loop lag and collector pauses"]
    assert "tiergate_event_loop_lag_seconds_bucket" in process
    assert "tiergate_gc_pause_seconds_sum" in process
    ids = [panel["id"] for panel in panels.values()]
    assert len(set(ids)) == len(ids)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels.values())


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)([smh])", duration)
    assert match is not None, duration
    return int(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]]


def test_prometheus_alert_is_the_in_process_alert() -> None:
    (alert,) = [rule for rule in _rules() if rule.get("alert") == ALERT_NAME]
    expr = " ".join(alert["expr"].split())
    window = f"[{int(DEFAULT_WINDOW_S // 60)}m]"
    assert alert["alert"] == ALERT_NAME
    assert _seconds(alert["for"]) == DEFAULT_FOR_S
    assert (
        f"histogram_quantile(0.99, sum by (tier, le) (rate(tiergate_ttft_seconds_bucket{window}))"
        in expr
    )
    assert f"(increase(tiergate_ttft_seconds_count{window})) >= {DEFAULT_MIN_SAMPLES}" in expr
    assert "> on (tier) max by (tier) (tiergate_ttft_alert_threshold_seconds)" in expr
    assert alert["labels"]["severity"] == "page"
