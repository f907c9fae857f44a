"""NVML: on this machine ``nvmlInit`` fails (no driver) and that is a clear reason; the meter's logic
runs against a FAKE pynvml module, a mock of GPU hardware that cannot exist here (the real meter on
a real GPU is ``tests/gpu/test_nvml_energy.py``)."""
from __future__ import annotations

import time
import types

import pytest

from edge.core.errors import ConfigError
from edge.energy.detect import open_meter
from edge.energy.meter import SensorUnavailable
from edge.energy.nvml import NvmlMeter


def fake_pynvml(power_mw=150_000, energy_mj=(1_000_000, 1_000_000, 1_250_500), counter=True, gpus=1,
                init_error: str | None = None, temperature: bool = True) -> types.SimpleNamespace:
    """A stand-in for the pynvml module: ``energy_mj`` are the total-energy counter's successive readings."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    calls = {"shutdown": 0, "temperature": 0}
    energy = iter(energy_mj)

    def init():
        if init_error:
            raise NVMLError(init_error)

    def total_energy(handle):
        if not counter:
            raise NVMLError_NotSupported("Not Supported")
        return next(energy)

    def temp(handle, sensor):
        calls["temperature"] += 1
        if not temperature:
            raise NVMLError_NotSupported("Not Supported")
        assert sensor == 0
        return 55

    return types.SimpleNamespace(
        NVMLError=NVMLError, NVMLError_NotSupported=NVMLError_NotSupported, NVML_TEMPERATURE_GPU=0, calls=calls,
        nvmlInit=init, nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: gpus, nvmlDeviceGetHandleByIndex=lambda i: f"handle{i}",
        nvmlDeviceGetName=lambda h: b"Fake GPU", nvmlDeviceGetPowerUsage=lambda h: power_mw,
        nvmlDeviceGetTotalEnergyConsumption=total_energy, nvmlDeviceGetTemperature=temp)


def test_no_driver_here_is_a_reason():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        reason = str(exc)
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here: the no-driver path cannot be reached")
    with pytest.raises(SensorUnavailable, match=f"^nvml: {reason}$"):
        NvmlMeter()
    with pytest.raises(ConfigError, match=f"power meter nvml is not available: nvml: {reason}"):
        open_meter("nvml")


def test_counter_is_preferred():
    nv = fake_pynvml()
    meter = NvmlMeter(0.01, nvml=nv)
    assert meter.counter and meter.rails == ["gpu0"] and "total-energy counter" in meter.reason
    meter.start()
    time.sleep(0.03)
    m = meter.stop()
    meter.close()
    # counter: 1 250 500 mJ - 1 000 000 mJ = 250.5 J, whatever the samples say
    assert m.source == "counter" and m.joules == pytest.approx(250.5)
    # samples: 150 000 mW -> 150 W, 55 degC
    assert len(m.samples) >= 2 and all(s.watts == 150.0 and s.temperature_c == 55.0 for s in m.samples)
    assert m.samples[0].rails == {"gpu0": 150.0}
    assert nv.calls["shutdown"] == 1


def test_sampled_fallback_without_the_counter():
    meter = NvmlMeter(0.01, nvml=fake_pynvml(power_mw=80_500, counter=False))
    assert not meter.counter and "no total-energy counter" in meter.reason
    meter.start()
    time.sleep(0.03)
    m = meter.stop()
    meter.close()
    # constant 80.5 W: the trapezoid is 80.5 W times the span of the samples
    assert m.source == "samples" and m.joules == pytest.approx(80.5 * (m.samples[-1].t - m.samples[0].t))


def test_temperature_unsupported_is_none_and_not_asked_again():
    nv = fake_pynvml(temperature=False)
    meter = NvmlMeter(0.01, nvml=nv)
    meter.start()
    time.sleep(0.03)
    m = meter.stop()
    meter.close()
    assert all(s.temperature_c is None for s in m.samples) and nv.calls["temperature"] == 1


def test_counter_going_back_is_an_error():
    meter = NvmlMeter(0.01, nvml=fake_pynvml(energy_mj=(5, 1000, 10)))  # e.g. the driver reloaded mid-window
    meter.start()
    with pytest.raises(ValueError, match="went back"):
        meter.stop()
    meter.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(init_error="Driver Not Loaded"), "^nvml: Driver Not Loaded$"),
    (dict(gpus=1), r"^nvml: no GPU index 3 \(1 GPU\(s\) visible\)$"),
])
def test_unavailable(kwargs, match):
    nv = fake_pynvml(**kwargs)
    with pytest.raises(SensorUnavailable, match=match):
        NvmlMeter(nvml=nv, device_index=3 if "gpus" in kwargs else 0)
    assert nv.calls["shutdown"] == (0 if "init_error" in kwargs else 1)  # initialised NVML is shut down


def test_device_index_through_detect():
    meter = open_meter("nvml", 0.05, device_index=1, nvml=fake_pynvml(gpus=2))
    assert meter.rails == ["gpu1"] and meter.reason.startswith("nvml: GPU 1 Fake GPU")
    meter.close()
