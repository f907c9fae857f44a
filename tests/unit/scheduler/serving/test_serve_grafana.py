"""deploy/monitoring against the server: every metric the Grafana dashboard queries is one ``/metrics``
exports, of the type the query treats it as; Prometheus scrapes the app's default port."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from scheduler.serving.config import ServeConfig
from scheduler.serving.dashboard import LivePower
from scheduler.serving.metrics import ServeMetrics
from tests.unit.scheduler.serving.test_serve_dashboard import FakeSensor
from tests.unit.scheduler.serving.test_serve_metrics import STATS

MONITORING = Path(__file__).resolve().parents[4] / "deploy" / "monitoring"
METRIC = re.compile(r"smartexit_[a-z0-9_]+")
COUNTER_FN = re.compile(r"\b(rate|increase|irate)\(\s*(smartexit_[a-z0-9_]+)")
# a sample name's suffix -> the family types that expose it (text exposition format)
SUFFIXES = {"_bucket": {"histogram"}, "_sum": {"histogram", "summary"}, "_count": {"histogram", "summary"},
            "_total": {"counter"}}


def grafana() -> dict:
    return json.loads((MONITORING / "grafana" / "smartexit-dashboard.json").read_text(encoding="utf-8"))


def panels(dash: dict):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # inside collapsed rows


def exposition() -> dict:
    """A real ServeMetrics as the ingress builds it, after one served request, with one replica's
    stats, its scheduler state and a power meter's reading: family name -> family."""
    m = ServeMetrics([2, 4], num_layers=6, sla_ttft_ms=500.0, sla_tpot_ms=50.0)
    m.record_tokens([2, 4, 6])
    m.record_request(200, ttft_s=0.1, e2e_s=0.3, completion_tokens=3, sla_ttft_ms=500, sla_tpot_ms=50)
    m.inflight.set(1)
    power = LivePower(FakeSensor())
    try:
        stats = {**STATS, "scheduler": {"policy": "ppo", "active": "aimd", "fallbacks": 1, "updates": 3},
                 "power": power.reading()}
    finally:
        power.close()
    m.set_replica_stats({"w1": stats})
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def family_of(name: str, fams: dict) -> tuple[str, set[str]]:
    """(family, the types it may have) of a queried sample name."""
    for suffix, kinds in SUFFIXES.items():
        if name.endswith(suffix) and name[: -len(suffix)] in fams:
            return name[: -len(suffix)], kinds
    return name, {"gauge"}


def test_every_panel_queries_only_exported_metrics_of_the_right_type():
    fams = exposition()
    dash = grafana()
    queried = set()
    for p in panels(dash):
        for t in p.get("targets", []):
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), (p["title"], expr)
            for name in METRIC.findall(expr):
                family, kinds = family_of(name, fams)
                assert family in fams, f"panel {p['title']!r} queries {name}, which /metrics does not export"
                assert fams[family].type in kinds, f"{name}: {family} is a {fams[family].type}, not {kinds}"
                assert name in {s.name for s in fams[family].samples}, f"{name}: no such sample in /metrics"
                queried.add(family)
            for fn, name in COUNTER_FN.findall(expr):  # rate() of a gauge is meaningless
                assert name.endswith(("_total", "_bucket", "_sum", "_count")), f"{fn}({name}) in {p['title']!r}"
    # the live page's panels all have their Grafana counterpart
    assert {"smartexit_ttft_seconds", "smartexit_time_per_output_token_seconds", "smartexit_sla_violations",
            "smartexit_requests", "smartexit_generated_tokens", "smartexit_exit_layer",
            "smartexit_prefill_budget_tokens", "smartexit_admission_limit", "smartexit_scheduler_active_policy",
            "smartexit_scheduler_fallbacks", "smartexit_queue_length", "smartexit_power_watts",
            "smartexit_device_temperature_celsius", "smartexit_sla_ttft_target_seconds",
            "smartexit_sla_tpot_target_seconds"} <= queried


def test_latency_panels_are_quantiles_over_the_histograms():
    exprs = [t["expr"] for p in panels(grafana()) for t in p.get("targets", [])]
    for family in ("smartexit_ttft_seconds", "smartexit_time_per_output_token_seconds"):
        for q in ("0.5", "0.95", "0.99"):
            assert (f"histogram_quantile({q}, sum by (le) (rate({family}_bucket[$__rate_interval])))"
                    in exprs), (family, q)


def test_every_panel_uses_the_datasource_variable():
    dash = grafana()
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_prometheus_scrapes_the_apps_default_bind():
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    defaults = ServeConfig()
    assert job["static_configs"][0]["targets"] == [f"{defaults.host}:{defaults.port}"]
    assert "credentials_file" in (MONITORING / "prometheus.yml").read_text()  # the key option, commented


@pytest.mark.parametrize("family", ["smartexit_power_watts", "smartexit_device_temperature_celsius"])
def test_power_gauges_carry_replica_and_meter(family):
    (s,) = exposition()[family].samples
    assert s.labels == {"replica": "w1", "meter": "fake-ina3221"} and s.value >= 5.0


def test_no_power_family_without_a_meter():
    m = ServeMetrics([2])
    m.set_replica_stats({"w1": STATS})
    names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    assert "smartexit_power_watts" not in names and "smartexit_sla_ttft_target_seconds" not in names
