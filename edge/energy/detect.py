"""Pick the power meter this machine has, the idle baseline, and energy per token.

``open_meter("auto")`` tries jtop, then tegrastats (both only on a Jetson), then NVML, then RAPL,
and without any returns :class:`NoSensor` whose reason says, per meter, why it is absent. An
explicit kind that cannot measure here is a :class:`ConfigError` carrying the reason.
"""
from __future__ import annotations

import inspect
import time
from enum import Enum
from typing import Any, Callable

from edge.core import device
from edge.core.errors import ConfigError, SmartExitError
from edge.energy.meter import Measurement, NoSensor, PowerMeter, SensorUnavailable


class MeterKind(str, Enum):
    AUTO = "auto"
    JTOP = "jtop"
    TEGRASTATS = "tegrastats"
    NVML = "nvml"
    RAPL = "rapl"
    NONE = "none"


AUTO_ORDER = (MeterKind.JTOP, MeterKind.TEGRASTATS, MeterKind.NVML, MeterKind.RAPL)


def on_jetson() -> bool:
    """A Jetson (L4T) has ``/etc/nv_tegra_release`` (:mod:`edge.core.device`)."""
    return device.TEGRA_RELEASE.exists()


def _meter_class(kind: MeterKind) -> type[PowerMeter]:
    if kind is MeterKind.JTOP:
        from edge.energy.jtop import JtopMeter

        return JtopMeter
    if kind is MeterKind.TEGRASTATS:
        from edge.energy.tegrastats import TegrastatsMeter

        return TegrastatsMeter
    if kind is MeterKind.NVML:
        from edge.energy.nvml import NvmlMeter

        return NvmlMeter
    from edge.energy.rapl import RaplMeter

    return RaplMeter


def _accepted(kind: MeterKind) -> set[str]:
    params = inspect.signature(_meter_class(kind).__init__).parameters
    return {p for p in params if p not in ("self", "interval_s", "clock")}


def _open(kind: MeterKind, interval_s: float, options: dict[str, Any]) -> PowerMeter:
    """One meter, or :class:`SensorUnavailable` with the reason it cannot measure here."""
    if kind in (MeterKind.JTOP, MeterKind.TEGRASTATS) and not on_jetson():
        raise SensorUnavailable(f"{kind.value}: not a Jetson (no {device.TEGRA_RELEASE})")
    cls = _meter_class(kind)
    mine = {k: v for k, v in options.items() if k in _accepted(kind)}
    try:
        return cls(interval_s, **mine)
    except SensorUnavailable:
        raise
    except SmartExitError as exc:  # a missing extra (MissingExtraError) is a reason too
        raise SensorUnavailable(f"{kind.value}: {exc}") from exc


def open_meter(kind: MeterKind | str = MeterKind.AUTO, interval_s: float = 0.1, **options: Any) -> PowerMeter:
    """The power meter to use.

    Args:
        kind: a :class:`MeterKind` or its value; ``auto`` picks the first that measures here.
        interval_s: the sampling interval.
        **options: passed to the meters that take them: ``rails`` (jtop, tegrastats), ``binary``,
            ``log_dir`` (tegrastats), ``device_index`` (nvml), ``root``, ``include_dram`` (rapl).

    Returns:
        The meter; with ``auto`` and no sensor, :class:`NoSensor` whose reason lists each meter's.

    Raises:
        ConfigError: an unknown kind, an option no meter of ``kind`` takes, or an explicit kind that
            cannot measure here (the message is the reason).
    """
    try:
        kind = MeterKind(kind)
    except ValueError:
        raise ConfigError(f"unknown power meter {kind!r}: one of {[k.value for k in MeterKind]}") from None
    candidates = AUTO_ORDER if kind is MeterKind.AUTO else () if kind is MeterKind.NONE else (kind,)
    known = set().union(*(_accepted(k) for k in (candidates or AUTO_ORDER)))
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"power meter {kind.value}: unknown option(s) {unknown}; it takes {sorted(known)}")
    if kind is MeterKind.NONE:
        return NoSensor("no power meter asked for (meter=none)", interval_s)
    reasons = []
    for k in candidates:
        try:
            return _open(k, interval_s, options)
        except SensorUnavailable as exc:
            if kind is not MeterKind.AUTO:
                raise ConfigError(f"power meter {k.value} is not available: {exc}") from exc
            reason = str(exc)
            reasons.append(reason if reason.startswith(f"{k.value}:") else f"{k.value}: {reason}")
    return NoSensor("; ".join(reasons), interval_s)


def measure_idle(meter: PowerMeter, seconds: float, sleep: Callable[[float], None] = time.sleep) -> Measurement:
    """The idle baseline before a run: measure ``seconds`` of sleeping.

    Raises:
        ValueError: ``seconds`` <= 0.
    """
    if seconds <= 0:
        raise ValueError(f"idle window must be > 0 s, got {seconds}")
    meter.start()
    sleep(seconds)
    return meter.stop()


def energy_per_token(measurement: Measurement, tokens: int, idle: Measurement | None = None) -> dict[str, Any]:
    """Joules per token, with and without the idle power over the same time, and CPU-seconds per token.

    Joules figures are None without a sensor (or without an idle measurement with joules, for the
    idle-subtracted ones); ``cpu_seconds_per_token`` is always there (the labelled proxy).

    Raises:
        ValueError: ``tokens`` < 1, or an idle baseline from another meter.
    """
    if tokens < 1:
        raise ValueError(f"energy per token needs tokens >= 1, got {tokens}")
    if idle is not None and idle.meter != measurement.meter:
        raise ValueError(f"idle baseline from meter {idle.meter!r}, run from {measurement.meter!r}")
    joules = measurement.joules
    idle_w = idle.mean_watts if idle is not None else None
    above = None if joules is None or idle_w is None else joules - idle_w * measurement.seconds
    return {
        "meter": measurement.meter,
        "available": measurement.available,
        "tokens": tokens,
        "seconds": measurement.seconds,
        "joules": joules,
        "joules_per_token": None if joules is None else joules / tokens,
        "idle_watts": idle_w,
        "joules_above_idle": above,
        "joules_per_token_above_idle": None if above is None else above / tokens,
        "cpu_seconds": measurement.cpu_seconds,
        "cpu_seconds_per_token": measurement.cpu_seconds / tokens,
    }
