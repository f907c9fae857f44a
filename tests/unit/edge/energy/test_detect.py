"""Meter detection (each absent meter's reason), explicit kinds, the idle baseline and energy per token."""
from __future__ import annotations

import pytest

from edge.core import device
from edge.core.errors import ConfigError
from edge.energy.detect import MeterKind, energy_per_token, measure_idle, open_meter
from edge.energy.meter import Measurement, NoSensor, PowerMeter, PowerSample
from tests.unit.edge.energy.test_nvml_meter import fake_pynvml


def no_gpu():
    return fake_pynvml(init_error="NVML Shared Library Not Found")


def test_auto_without_any_sensor_lists_every_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "TEGRA_RELEASE", tmp_path / "nv_tegra_release")  # absent: not a Jetson
    meter = open_meter("auto", 0.05, nvml=no_gpu(), root=tmp_path / "powercap")
    assert isinstance(meter, NoSensor) and not meter.available
    assert meter.reason == (f"jtop: not a Jetson (no {tmp_path / 'nv_tegra_release'}); "
                            f"tegrastats: not a Jetson (no {tmp_path / 'nv_tegra_release'}); "
                            "nvml: NVML Shared Library Not Found; "
                            f"rapl: no {tmp_path / 'powercap'} (no powercap driver, or not exposed here)")
    m = measure_idle(meter, 0.01)
    assert m.joules is None and m.meter == "none" and m.reason == meter.reason


def test_auto_on_a_jetson_without_jtop_service_or_tegrastats(tmp_path, monkeypatch):
    release = tmp_path / "nv_tegra_release"
    release.write_text("# R36 (release), REVISION: 4.3\n")
    monkeypatch.setattr(device, "TEGRA_RELEASE", release)

    def no_service(interval):
        from tests.unit.edge.energy.test_jtop_meter import FakeJtop

        return FakeJtop(interval, fail="The jtop.service is not active. Please run:\nsudo jtop --install-service")

    meter = open_meter("auto", jtop_factory=no_service, binary="no-such-tegrastats-xyz", nvml=no_gpu(),
                       root=tmp_path / "powercap")
    reasons = meter.reason.split("; ")
    assert reasons[0] == "jtop: The jtop.service is not active. Please run: sudo jtop --install-service"
    assert reasons[1] == "tegrastats: 'no-such-tegrastats-xyz' not found on PATH"


def test_auto_takes_the_first_that_measures(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "TEGRA_RELEASE", tmp_path / "absent")
    meter = open_meter("auto", nvml=fake_pynvml())
    assert meter.name == "nvml" and meter.available
    meter.close()


def test_explicit_kinds_and_options(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "TEGRA_RELEASE", tmp_path / "absent")
    with pytest.raises(ConfigError, match="power meter tegrastats is not available: tegrastats: not a Jetson"):
        open_meter("tegrastats")
    with pytest.raises(ConfigError, match="power meter nvml is not available: nvml: NVML Shared Library"):
        open_meter(MeterKind.NVML, nvml=no_gpu())
    with pytest.raises(ConfigError, match="unknown power meter 'watts'"):
        open_meter("watts")
    with pytest.raises(ConfigError, match=r"power meter nvml: unknown option\(s\) \['root'\]"):
        open_meter("nvml", root=tmp_path)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['colour'\]"):
        open_meter("auto", colour="red")
    none = open_meter("none")
    assert isinstance(none, NoSensor) and "meter=none" in none.reason


class Constant(PowerMeter):
    """A meter of a constant power on a hand-driven clock (for the baseline arithmetic)."""

    name = "const"

    def __init__(self, watts: float, clock_values: list[float]) -> None:
        ticks = iter(clock_values)
        super().__init__(0.1, clock=lambda: next(ticks))
        self.watts = watts

    def _start(self) -> None:
        self._begin = self.clock()

    def _stop(self):
        end = self.clock()
        return self.watts * (end - self._begin), "samples", [PowerSample(self._begin, self.watts),
                                                             PowerSample(end, self.watts)]


def test_measure_idle_sleeps_inside_the_window():
    slept = []
    m = measure_idle(Constant(3.0, [0.0, 0.0, 2.0, 2.0]), 2.0, sleep=slept.append)
    assert slept == [2.0] and m.seconds == 2.0 and m.joules == 6.0 and m.mean_watts == 3.0
    with pytest.raises(ValueError, match="> 0"):
        measure_idle(Constant(3.0, []), 0)


def measurement(meter="const", joules=12.0, seconds=2.0, cpu=1.0) -> Measurement:
    return Measurement(meter, joules is not None, "", [], 0.1, seconds, cpu, joules,
                       "samples" if joules is not None else None)


def test_energy_per_token_by_hand():
    run, idle = measurement(joules=12.0, seconds=2.0, cpu=1.0), measurement(joules=3.0, seconds=1.0)
    e = energy_per_token(run, 40, idle)
    # 12 J / 40 = 0.3 J/token; idle 3 W over the run's 2 s = 6 J; (12 - 6) / 40 = 0.15; 1 CPU-s / 40
    assert e["joules_per_token"] == pytest.approx(0.3) and e["idle_watts"] == 3.0
    assert e["joules_above_idle"] == pytest.approx(6.0) and e["joules_per_token_above_idle"] == pytest.approx(0.15)
    assert e["cpu_seconds_per_token"] == pytest.approx(0.025)
    assert energy_per_token(run, 40)["joules_per_token_above_idle"] is None
    none = energy_per_token(measurement("none", joules=None), 10, measurement("none", joules=None))
    assert none["joules_per_token"] is None and none["joules_per_token_above_idle"] is None
    assert none["cpu_seconds_per_token"] == pytest.approx(0.1) and none["available"] is False
    with pytest.raises(ValueError, match="tokens >= 1"):
        energy_per_token(run, 0)
    with pytest.raises(ValueError, match="idle baseline from meter 'none'"):
        energy_per_token(run, 4, measurement("none", joules=None))
