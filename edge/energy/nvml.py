"""NvmlMeter: an NVIDIA GPU's energy through NVML (``pynvml`` from nvidia-ml-py, the ``gpu`` extra).

Preferred: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded, Volta and later;
NVML API reference, Device Queries): joules are the counter's difference over the window (source
"counter"), and ``nvmlDeviceGetPowerUsage`` (mW) is still sampled for the power-over-time plot.
Where the counter raises ``NVMLError_NotSupported`` the sampled power is integrated by the
trapezoid (source "samples"). Both cover the whole board the driver measures (GPU and its memory),
not the host. On some data-centre GPUs ``nvmlDeviceGetPowerUsage`` is itself a one-second average,
another reason to prefer the counter.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from edge.core.errors import require
from edge.energy.meter import PowerSample, SampledMeter, SensorUnavailable, counter_delta


def nvml_reason(exc: BaseException) -> str:
    """An NVML error as one line ('NVML Shared Library Not Found', 'Driver Not Loaded', ...)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class NvmlMeter(SampledMeter):
    """Energy of GPU ``device_index``; ``nvml`` replaces the ``pynvml`` module (tests)."""

    name = "nvml"

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic, device_index: int = 0,
                 nvml: Any | None = None) -> None:
        super().__init__(interval_s, clock)
        self.nvml = require("pynvml", "gpu") if nvml is None else nvml
        self.device_index = device_index
        self._initialised = False
        try:
            self.nvml.nvmlInit()
            self._initialised = True
            count = self.nvml.nvmlDeviceGetCount()
            if not 0 <= device_index < count:
                raise SensorUnavailable(f"nvml: no GPU index {device_index} ({count} GPU(s) visible)")
            self._handle = self.nvml.nvmlDeviceGetHandleByIndex(device_index)
            gpu = self.nvml.nvmlDeviceGetName(self._handle)
            self.gpu_name = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
            self.nvml.nvmlDeviceGetPowerUsage(self._handle)  # every mode samples power
            self.counter = self._counter_supported()
        except self.nvml.NVMLError as exc:
            self.close()
            raise SensorUnavailable(f"nvml: {nvml_reason(exc)}") from exc
        except SensorUnavailable:
            self.close()
            raise
        self._temperature_ok = True
        self._energy0: int | None = None
        self.source = "counter" if self.counter else "samples"
        how = ("total-energy counter (mJ); power sampled every "
               f"{interval_s} s for the plot" if self.counter else
               f"power sampled every {interval_s} s, trapezoid (this GPU has no total-energy counter)")
        self.reason = f"nvml: GPU {device_index} {self.gpu_name}, {how}"

    def _counter_supported(self) -> bool:
        try:
            self.nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except self.nvml.NVMLError_NotSupported:
            return False
        return True

    @property
    def rails(self) -> list[str]:
        return [f"gpu{self.device_index}"]

    def _energy_mj(self) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def _temperature(self) -> float | None:
        if not self._temperature_ok:
            return None
        try:
            return float(self.nvml.nvmlDeviceGetTemperature(self._handle, self.nvml.NVML_TEMPERATURE_GPU))
        except self.nvml.NVMLError:  # no sensor or a driver without the call: stop asking, report None
            self._temperature_ok = False
            return None

    def _read(self) -> PowerSample:
        watts = self.nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3  # mW -> W
        return PowerSample(self.clock(), watts, {self.rails[0]: watts}, self._temperature())

    def _start(self) -> None:
        if self.counter:
            self._energy0 = self._energy_mj()
        super()._start()

    def _stop(self) -> tuple[float | None, str | None, list[PowerSample]]:
        joules, source, samples = super()._stop()
        if self.counter:
            assert self._energy0 is not None
            # the counter counts from driver load and does not wrap (64-bit mJ): a smaller end is an error
            joules = counter_delta(self._energy0, self._energy_mj(), None) / 1e3  # mJ -> J
        return joules, source, samples

    def close(self) -> None:
        super().close()
        if self._initialised:
            self._initialised = False
            self.nvml.nvmlShutdown()
