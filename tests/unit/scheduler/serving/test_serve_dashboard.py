"""The live dashboard's data (scheduler/serving/dashboard.py) against hand-computed series, its power
panel with a synthetic meter, and the page's files: vendored uPlot by sha256, package data."""
from __future__ import annotations

import fnmatch
import hashlib
import re
import sys
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest

from edge.core.errors import ConfigError
from edge.energy.meter import NoSensor, PowerSample, SampledMeter
from scheduler.serving import dashboard
from scheduler.serving.config import ServeConfig
from scheduler.serving.dashboard import ASSETS, PAGE, Dashboard, LivePower, open_power, static_file
from scheduler.serving.metrics import ServeMetrics

ROOT = Path(__file__).resolve().parents[4]
STATIC = ROOT / "scheduler" / "serving" / "static"
UPLOT_SHA256 = {  # static/vendor/uplot/README.md: uPlot 1.6.32 from registry.npmjs.org
    "uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
    "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
    "LICENSE": "8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd",
}


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeSensor(SampledMeter):
    """Stands in for a power sensor this machine does not have: 5 W + 0.5 W per reading, 40 + 1 C."""

    name = "fake-ina3221"

    def __init__(self, interval_s: float = 0.01, clock=None) -> None:
        super().__init__(interval_s, **({} if clock is None else {"clock": clock}))
        self.reads = 0

    def _read(self) -> PowerSample:
        self.reads += 1
        return PowerSample(self.clock(), 5.0 + 0.5 * (self.reads - 1), {"VDD_IN": 5.0 + 0.5 * (self.reads - 1)},
                           40.0 + (self.reads - 1))


def stats(waiting=2, running=3, budget=256, limit=8, **extra) -> dict:
    return {"waiting": waiting, "running": running, "prefill_budget": budget, "max_running": limit, **extra}


def make(clock: Clock, wall: Clock | None = None, **kw) -> tuple[ServeMetrics, Dashboard]:
    m = ServeMetrics([2, 4], num_layers=6, window_s=10.0, clock=clock)
    d = Dashboard(m, (2, 4), 6, sla_ttft_ms=500.0, sla_tpot_ms=50.0, wall=wall or Clock(1_700_000_000.0), **kw)
    return m, d


# -- the series ---------------------------------------------------------------------------------------
def test_latency_percentiles_attainment_and_goodput_over_the_window():
    """Percentiles are numpy's (the benchmark's) over the requests finished in the last window;
    attainment counts served, refused (429) and failed (5xx) requests, not client errors (400) or
    disconnects (499); goodput is the requests meeting their SLA per second of the window."""
    clock = Clock()
    m, d = make(clock)
    clock.t += 20  # the server has run longer than a window
    m.record_request(200, ttft_s=9.0, e2e_s=9.5, completion_tokens=11, sla_ttft_ms=500, sla_tpot_ms=50)  # will age out
    clock.t += 11
    ttfts = [0.1, 0.2, 0.3, 0.6]  # the last misses its TTFT target
    for ttft in ttfts:  # 11 tokens, 0.02 s each after the first: within the TPOT target
        m.record_request(200, ttft_s=ttft, e2e_s=ttft + 0.2, completion_tokens=11, sla_ttft_ms=500, sla_tpot_ms=50)
    m.record_request(429)
    m.record_request(503)
    m.record_request(400)
    m.record_request(499)
    row = d.sample()
    want = np.percentile([1e3 * t for t in ttfts], [50, 95, 99])
    assert [row["ttft_p50_ms"], row["ttft_p95_ms"], row["ttft_p99_ms"]] == pytest.approx(want, abs=1e-3)
    assert row["tpot_p50_ms"] == pytest.approx(20.0, abs=1e-3) and row["tpot_p99_ms"] == pytest.approx(20.0, abs=1e-3)
    assert row["requests"] == 6  # 4 served + 429 + 503
    assert row["sla_attainment"] == pytest.approx(3 / 6, abs=1e-3)
    assert row["goodput_rps"] == pytest.approx(3 / 10.0, abs=1e-3)

    clock.t += 30  # everything aged out: no latency, no attainment, zero goodput
    row = d.sample()
    assert row["ttft_p50_ms"] is None and row["tpot_p99_ms"] is None
    assert row["requests"] == 0 and row["sla_attainment"] is None and row["goodput_rps"] == 0.0


def test_a_young_server_divides_goodput_by_its_age_not_the_whole_window():
    clock = Clock()
    m, d = make(clock)
    clock.t += 2
    m.record_request(200, ttft_s=0.1, e2e_s=0.2, completion_tokens=2, sla_ttft_ms=500, sla_tpot_ms=500)
    assert d.sample()["goodput_rps"] == pytest.approx(0.5)


def test_replica_sums_policy_fallbacks_and_the_ring_buffer():
    """Queue, running, budget and limit are summed over replicas; ``fallback`` is 1 while a replica's
    learned policy has handed control to its heuristic, ``fallback_events`` counts new hand-overs;
    the buffer keeps ``points`` rows and ``data(since)`` only the newer ones."""
    clock, wall = Clock(), Clock(1_700_000_000.0)
    m, d = make(clock, wall, points=3)
    ppo = {"policy": "ppo", "active": "ppo", "fallbacks": 0, "updates": 4}
    m.set_replica_stats({"a": stats(scheduler=ppo), "b": stats(waiting=1, budget=128, limit=4, scheduler=ppo)})
    row = d.sample()
    assert (row["queue"], row["running"], row["prefill_budget"], row["admission_limit"]) == (3, 6, 384, 12)
    assert row["fallback"] == 0 and row["fallback_events"] is None  # no earlier row to count from
    wall.t += 1
    m.set_replica_stats({"a": stats(scheduler={**ppo, "active": "aimd", "fallbacks": 2}), "b": stats(scheduler=ppo)})
    row = d.sample()
    assert row["fallback"] == 1 and row["fallback_events"] == 2
    out = d.data()
    assert out["scheduler"]["a"] == {"policy": "ppo", "active": "aimd", "fallbacks": 2, "updates": 4}
    assert out["replicas"] == 2
    for _ in range(3):
        wall.t += 1
        d.sample()
    out = d.data()
    assert out["points"] == 3 and out["tick_s"] == 1.0 and out["series"]["t"] == [1_700_000_002.0, 1_700_000_003.0, 1_700_000_004.0]
    assert set(out["series"]) == set(dashboard.SERIES)
    assert all(len(col) == 3 for col in out["series"].values())
    assert d.data(since=1_700_000_003.0)["series"]["t"] == [1_700_000_004.0]
    assert d.data(since=1_700_000_004.0)["series"]["t"] == []

    m.set_replica_stats({})  # every worker gone: gaps, not zeros
    row = d.sample()
    assert row["queue"] is None and row["fallback"] is None and d.data()["replicas"] == 0


def test_the_audits_are_pooled_over_replicas_against_epsilon():
    """False exits: the replicas' audited tokens and false exits summed, their rate and Clopper-Pearson upper bound
    at the audits' delta, the certificate's epsilon; per replica its per-request test and fallback. No audit: gaps."""
    from edge.runtime.audit import clopper_pearson

    m, d = make(Clock())
    test = {"requests": 400, "mean": 0.0, "p_value": 0.04, "certified": True, "incomplete": 0}
    m.set_replica_stats({"a": stats(audit={"audited": 900, "false": 3, "delta": 0.05, "epsilon": 0.009,
                                           "fallback": False, "requests": test}),
                         "b": stats(audit={"audited": 100, "false": 1, "delta": 0.05, "epsilon": 0.009,
                                           "fallback": True, "requests": None}),
                         "c": stats()})
    row = d.sample()
    assert row["false_exit_rate"] == pytest.approx(0.004)
    assert row["false_exit_upper"] == pytest.approx(clopper_pearson(4, 1000, 0.05)[1], abs=1e-6)
    audit = d.data()["audit"]
    assert (audit["audited"], audit["false"], audit["epsilon"]) == (1000, 4, 0.009)
    assert audit["replicas"] == {"a": {"requests": test, "fallback": False}, "b": {"requests": None, "fallback": True}}
    m.set_replica_stats({"c": stats()})
    row = d.sample()
    assert row["false_exit_rate"] is None and row["false_exit_upper"] is None and d.data()["audit"]["audited"] == 0


def test_exit_layer_histogram_since_the_start_and_over_the_window():
    clock = Clock()
    m, d = make(clock)
    m.record_tokens([2, 2, 6])
    d.sample()
    clock.t += 20  # that sample is older than the window now
    d.sample()
    m.record_tokens([4, 6, 6])
    clock.t += 1
    d.sample()
    ex = d.data()["exit_layers"]
    assert ex["layers"] == [2, 4, 6]
    assert ex["total"] == [2, 1, 3]
    assert ex["recent"] == [0, 1, 2]  # since the oldest sample inside the window


def test_tokens_per_second_is_the_metrics_own():
    clock = Clock()
    m, d = make(clock)
    m.record_tokens([2] * 50)
    assert d.sample()["tokens_per_s"] == pytest.approx(m.tokens_per_second()) == pytest.approx(5.0)


# -- power ----------------------------------------------------------------------------------------------
def test_power_panel_from_a_sampled_meter():
    """A synthetic sampled meter behind LivePower (as a worker runs it): its reading travels in the
    replica's stats; the dashboard sums watts, takes the hottest device and divides by tokens/s."""
    meter = FakeSensor()
    power = LivePower(meter)
    try:
        first = power.reading()  # start() takes one reading at once
        assert first["meter"] == "fake-ina3221" and first["available"] is True
        assert first["watts"] >= 5.0 and first["temperature_c"] >= 40.0 and "VDD_IN" in first["rails"]
        clock = Clock()
        m, d = make(clock, power_meter="auto")
        m.record_tokens([2] * 100)  # 10 tokens/s over the 10 s window
        a = {**first, "watts": 6.0, "temperature_c": 45.0}
        b = {**first, "watts": 4.0, "temperature_c": 51.0}
        m.set_replica_stats({"a": stats(power=a), "b": stats(power=b)})
        row = d.sample()
        assert row["watts"] == 10.0 and row["temperature_c"] == 51.0
        assert row["joules_per_token"] == pytest.approx(10.0 / 10.0)
        assert d.data()["power"] == {"available": True, "reason": "", "meters": {"a": "fake-ina3221",
                                                                                 "b": "fake-ina3221"}}
    finally:
        power.close()


def test_live_power_rolls_the_meters_window():
    """The meter keeps a window's samples until stop(): LivePower restarts the window every roll_s."""
    clock = Clock()
    meter = FakeSensor(interval_s=3600.0)  # no thread readings: only start()'s and stop()'s
    power = LivePower(meter, roll_s=60.0, clock=clock)
    try:
        assert not power.roll_due()
        clock.t += 60
        assert power.roll_due()
        m = power.roll()
        assert m.meter == "fake-ina3221" and len(m.samples) == 2 and m.joules is not None
        assert not power.roll_due()
        assert power.reading()["watts"] == 6.0  # the new window's first reading (the third read)
    finally:
        power.close()


def test_no_meter_and_no_sensor_show_their_reason():
    clock = Clock()
    m, d = make(clock)
    row = d.sample()
    assert row["watts"] is None and row["joules_per_token"] is None
    assert d.data()["power"] == {"available": False, "reason": dashboard.NO_METER_REASON, "meters": {}}

    reading = LivePower(NoSensor("no RAPL, NVML or Jetson rails readable"))
    m.set_replica_stats({"a": stats(power=reading.reading())})
    d.sample()
    status = d.data()["power"]
    assert status["available"] is False and status["reason"] == "no RAPL, NVML or Jetson rails readable"


def test_open_power_is_lazy_and_names_what_is_missing(monkeypatch):
    assert open_power("none", 0.25) is None
    monkeypatch.setitem(sys.modules, "edge.energy.detect", None)  # as if detect.py were not installed
    with pytest.raises(ConfigError, match=r"serve.power_meter='auto' needs edge.energy.detect"):
        open_power("auto", 0.25)
    fake = types.ModuleType("edge.energy.detect")
    asked = []
    fake.open_meter = lambda kind="auto", interval_s=0.1: asked.append((kind, interval_s)) or FakeSensor()
    monkeypatch.setitem(sys.modules, "edge.energy.detect", fake)
    power = open_power("auto", 0.25)
    try:
        assert asked == [("auto", 0.25)] and power.reading()["watts"] == 5.0
    finally:
        power.close()


def test_config_fields():
    assert ServeConfig().power_meter == "none"
    with pytest.raises(ConfigError, match="serve.power_meter"):
        ServeConfig(power_meter=" ")
    with pytest.raises(ConfigError, match="serve.dashboard_points"):
        ServeConfig(dashboard_points=0)
    with pytest.raises(ConfigError, match="serve.dashboard_tick_s"):
        ServeConfig(dashboard_tick_s=0)


# -- the page's files --------------------------------------------------------------------------------
def test_vendored_uplot_is_the_published_release():
    vendor = STATIC / "vendor" / "uplot"
    readme = (vendor / "README.md").read_text()
    for name, digest in UPLOT_SHA256.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
        assert digest in readme, f"README.md does not list {name}'s sha256"
    assert "MIT" in (vendor / "LICENSE").read_text()


def test_the_page_loads_only_served_assets_and_they_are_package_data():
    """Every script and stylesheet the page names is one the app serves (nothing from a CDN), every
    served file exists, and pyproject's package-data patterns ship each of them in a wheel."""
    page = static_file(PAGE).decode()
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(r.startswith("dashboard/static/") or r.startswith("data:") for r in refs), refs
    assert {r.removeprefix("dashboard/static/") for r in refs if not r.startswith("data:")} <= set(ASSETS)
    for name in ASSETS:
        assert static_file(name)
    with pytest.raises(KeyError):
        static_file("../config.py")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "scheduler.serving"]
    for name in [PAGE, *ASSETS, "vendor/uplot/LICENSE"]:
        assert any(fnmatch.fnmatch(f"static/{name}", p) for p in patterns), name
