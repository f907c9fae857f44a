"""The power-meter interface: start, stop, timestamped samples, joules, which rails.

A :class:`PowerMeter` measures a window: ``start()``, the work, ``stop()`` -> :class:`Measurement`.
Meters that read a cumulative energy counter (RAPL, NVML's total-energy counter) report the
counter's difference; meters that read power report the trapezoidal integral of their samples.
Either way the samples are kept (the power-over-time plot, the live dashboard reads ``latest()``).

Every measurement also carries the process's CPU-seconds over the window (``resource.getrusage``,
threads included): where no sensor exists (:class:`NoSensor`) that is the only number, a clearly
labelled proxy; joules are then None. Nothing here estimates energy from a TDP or a model.

Pure parts (:func:`trapezoid_joules`, :func:`counter_delta`) are functions on arrays; a sampled
meter subclasses :class:`SampledMeter` and implements ``_read()``; the thread and the bookkeeping
are here.
"""
from __future__ import annotations

import abc
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from edge.core.errors import SmartExitError


class SensorUnavailable(SmartExitError):
    """This meter cannot measure here (no such device, driver, service or permission); the message is
    the reason :func:`edge.energy.detect.open_meter` reports."""


@dataclass(frozen=True)
class PowerSample:
    """One reading. ``t``: seconds on the meter's clock (monotonic); ``watts``: the summed rails."""

    t: float
    watts: float
    rails: dict[str, float] = field(default_factory=dict)  # each rail as read, watts
    temperature_c: float | None = None  # the device's temperature where the meter reports one


@dataclass
class Measurement:
    """What one window measured."""

    meter: str  # the meter's name ("rapl", "nvml", "jtop", "tegrastats", "none")
    available: bool  # a real sensor (False: joules is None, cpu_seconds is the proxy)
    reason: str  # why there is no sensor, or what was measured (e.g. which rails, counter or samples)
    rails: list[str]  # the rails summed into watts / joules
    interval_s: float  # the sampling interval asked for
    seconds: float  # the window's wall time
    cpu_seconds: float  # process user + system CPU time over the window (always measured)
    joules: float | None  # energy over the window; None without a sensor
    source: str | None  # "counter" (cumulative energy difference) or "samples" (trapezoid); None without a sensor
    samples: list[PowerSample] = field(default_factory=list)

    @property
    def mean_watts(self) -> float | None:
        return None if self.joules is None or self.seconds <= 0 else self.joules / self.seconds

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["mean_watts"] = self.mean_watts
        if not with_samples:
            d.pop("samples")
            d["n_samples"] = len(self.samples)
        return d


def trapezoid_joules(t: Sequence[float], watts: Sequence[float]) -> float:
    """Energy of a power curve by the trapezoidal rule (t ascending, seconds; watts). 0 for < 2 samples.

    Raises:
        ValueError: lengths differ, or t decreases.
    """
    if len(t) != len(watts):
        raise ValueError(f"{len(t)} timestamps but {len(watts)} power readings")
    total = 0.0
    for i in range(1, len(t)):
        dt = t[i] - t[i - 1]
        if dt < 0:
            raise ValueError(f"timestamps go back at sample {i}: {t[i - 1]} -> {t[i]}")
        total += 0.5 * (watts[i] + watts[i - 1]) * dt
    return total


def counter_delta(start: int, end: int, max_range: int | None) -> int:
    """Increase of a cumulative counter from ``start`` to ``end`` that wraps to 0 after ``max_range``
    (RAPL's ``max_energy_range_uj``); None: the counter does not wrap (a smaller end is an error).
    One wrap at most is assumed: read often enough that the counter cannot wrap twice.

    Raises:
        ValueError: the counter went back and cannot wrap, or a reading outside [0, max_range].
    """
    if end >= start:
        return end - start
    if max_range is None:
        raise ValueError(f"energy counter went back ({start} -> {end}) and does not wrap")
    if not (0 <= end <= max_range and 0 <= start <= max_range):
        raise ValueError(f"energy counter reading outside [0, {max_range}]: {start} -> {end}")
    return max_range - start + end + 1


def cpu_seconds() -> float:
    """This process's user + system CPU time so far, all threads (ONNX Runtime's pool included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class PowerMeter(abc.ABC):
    """Measures a window of work; see the module docstring."""

    name = "abstract"
    available = True
    reason = ""

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"sampling interval must be > 0, got {interval_s}")
        self.interval_s, self.clock = interval_s, clock
        self._t0: float | None = None
        self._cpu0 = 0.0

    @property
    def rails(self) -> list[str]:
        """The rails summed (names as the sensor gives them)."""
        return []

    def start(self) -> None:
        if self._t0 is not None:
            raise RuntimeError(f"{self.name} meter already started")
        self._cpu0 = cpu_seconds()
        self._t0 = self.clock()
        try:
            begun = self._start()
        except BaseException:
            self._t0 = None  # a failed start leaves the meter stopped, so it can be started again
            raise
        if begun is not None:  # the first reading came later (a spawned tegrastats): the window starts there
            self._t0, self._cpu0 = begun, cpu_seconds()

    def stop(self) -> Measurement:
        if self._t0 is None:
            raise RuntimeError(f"{self.name} meter was not started")
        seconds = self.clock() - self._t0  # the window ends when stop() is called, not after the last reading
        try:
            joules, source, samples = self._stop()
        except BaseException:
            self._t0 = None  # the window is lost, the meter is stopped
            raise
        self._t0 = None
        return Measurement(self.name, self.available, self.reason, self.rails, self.interval_s, seconds,
                           cpu_seconds() - self._cpu0, joules, source, samples)

    def latest(self) -> PowerSample | None:
        """The most recent reading (for a live view), or None."""
        return None

    def close(self) -> None:
        """Release the sensor (threads, subprocesses, library handles)."""

    def __enter__(self) -> "PowerMeter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abc.abstractmethod
    def _start(self) -> float | None:
        """Begin a window; return None, or the clock time the window begins at if later than the call
        (a meter that must wait for its first reading)."""

    @abc.abstractmethod
    def _stop(self) -> tuple[float | None, str | None, list[PowerSample]]:
        """(joules, source, samples) of the window just ended."""


class NoSensor(PowerMeter):
    """No power sensor on this machine: measures CPU-seconds only (the labelled proxy), never joules."""

    name = "none"
    available = False

    def __init__(self, reason: str, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(interval_s, clock)
        self.reason = reason

    def _start(self) -> None:
        pass

    def _stop(self) -> tuple[float | None, str | None, list[PowerSample]]:
        return None, None, []


class SampledMeter(PowerMeter):
    """A meter that reads power every ``interval_s`` on a thread; joules by the trapezoid over the window
    (the last reading before ``start`` and the first after ``stop`` are not interpolated: the window is
    the samples taken inside it, and one taken at each end)."""

    source = "samples"

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(interval_s, clock)
        self._samples: list[PowerSample] = []
        self._latest: PowerSample | None = None
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: Exception | None = None  # a reading that failed on the thread, raised by stop()

    @abc.abstractmethod
    def _read(self) -> PowerSample:
        """One reading now (stamped with ``self.clock()``)."""

    def latest(self) -> PowerSample | None:
        return self._latest

    def _record(self, s: PowerSample) -> None:
        with self._lock:
            self._samples.append(s)
            self._latest = s

    def _loop(self) -> None:
        try:
            while not self._stop_evt.wait(self.interval_s):
                self._record(self._read())
        except Exception as exc:  # kept for stop(): a sensor failing mid-window must not shorten it silently
            self._error = exc

    def _start(self) -> None:
        self._samples = []
        self._error = None
        self._stop_evt.clear()
        self._record(self._read())
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-meter", daemon=True)
        self._thread.start()

    def _stop(self) -> tuple[float | None, str | None, list[PowerSample]]:
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise SmartExitError(f"{self.name} meter: a reading failed during the window: "
                                 f"{type(self._error).__name__}: {self._error}") from self._error
        self._record(self._read())
        with self._lock:
            samples = list(self._samples)
        return trapezoid_joules([s.t for s in samples], [s.watts for s in samples]), self.source, samples

    def close(self) -> None:
        self._stop_evt.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
