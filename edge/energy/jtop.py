"""JtopMeter: Jetson power rails through jetson-stats' ``jtop`` service (the ``jetson`` extra).

``jtop().power`` (jetson-stats 4.x to 7.x, ``jtop/core/power.py``) is ``{'rail': {name: {...}},
'tot': {...}}`` with ``power`` (instantaneous) and ``avg`` in mW per rail. Its ``avg`` is not a
window mean (each update halves the distance to the new reading), so the meter samples ``power`` and
integrates by the trapezoid. jtop's total is one rail where a board has an input rail (``VIN`` on
Thor, ``POM_5V_IN`` on Nano, ``VDD_IN`` on Orin NX / Nano: it moves that rail from ``rail`` to
``tot`` and names it), otherwise the sum of every rail it lists: on AGX Orin no rail measures the
whole board, and jtop's sum includes ``VDDQ_VDD2_1V8AO`` where the kernel lists it (JetPack 5 /
6.0), which :mod:`edge.energy.rails` does not add. ``rails=`` sums named rails instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from edge.core.errors import require
from edge.energy.meter import PowerSample, SampledMeter, SensorUnavailable
from edge.energy.rails import AGX_ORIN_SUMMED, hottest_c, select_rails

OFFLINE_C = -256.0


@dataclass(frozen=True)
class JtopPower:
    """One ``jtop().power`` reading in watts."""

    total_w: float  # jtop's total
    total_rails: tuple[str, ...]  # what that total is: one named input rail, or every rail summed
    total_is_sum: bool
    rails_w: dict[str, float]  # every rail jtop reports, its named total rail included

    def describe(self) -> str:
        if not self.total_is_sum:
            return f"jtop's total: {self.total_rails[0]}, the input rail"
        extra = sorted(set(self.total_rails) - set(AGX_ORIN_SUMMED))
        note = (f"; it includes {', '.join(extra)}, which the tegrastats meter does not add (rails=... to match)"
                if extra and set(AGX_ORIN_SUMMED) <= set(self.total_rails) else "")
        return (f"jtop's total: the sum of every rail it lists, {' + '.join(self.total_rails)} (no rail measures "
                f"the whole board, as on AGX Orin: not the board's input power){note}")


def _mw(entry: Any, where: str) -> float:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("power"), (int, float)):
        raise ValueError(f"jtop power {where}: expected a dict with a numeric 'power' (mW), got {entry!r}")
    return float(entry["power"])


def jtop_power(power: Mapping[str, Any]) -> JtopPower:
    """Convert ``jtop().power`` to watts, naming what jtop's total sums.

    Raises:
        ValueError: no sensors (``{}``), not the ``{'rail': .., 'tot': ..}`` shape, a rail without a
            numeric ``power``, or an unnamed total that is not the sum of the rails (an unknown jtop).
    """
    if not power:
        raise ValueError("jtop reports no power sensors (empty jetson.power)")
    if not isinstance(power.get("rail"), Mapping) or not isinstance(power.get("tot"), Mapping):
        raise ValueError(f"not a jetson-stats >= 4 power dict {{'rail': {{..}}, 'tot': {{..}}}}: keys {sorted(power)}")
    rails = {name: _mw(entry, f"rail {name}") / 1e3 for name, entry in power["rail"].items()}
    tot = power["tot"]
    total = _mw(tot, "tot") / 1e3
    name = tot.get("name")
    if name:
        return JtopPower(total, (str(name),), False, {**rails, str(name): total})
    if not rails:
        raise ValueError("jtop's total has no name and there are no rails it could sum")
    summed = sum(rails.values())
    if abs(summed - total) > 1e-3 * len(rails):  # jtop adds integer mW: equal up to rounding
        raise ValueError(f"jtop's unnamed total {total:.3f} W is not the sum of its rails {summed:.3f} W "
                         f"({sorted(rails)}): unknown jtop power format")
    return JtopPower(total, tuple(sorted(rails)), True, rails)


def jtop_temperatures(temperature: Mapping[str, Any]) -> dict[str, float]:
    """``jtop().temperature`` ({'cpu': {'temp': 46.0, 'online': True}, ..}) -> online sensors, degC."""
    out = {}
    for name, entry in temperature.items():
        if isinstance(entry, Mapping) and entry.get("online", True) and isinstance(entry.get("temp"), (int, float)):
            if float(entry["temp"]) != OFFLINE_C:
                out[name] = float(entry["temp"])
    return out


def jtop_sample(power: Mapping[str, Any], t: float, temperature: Mapping[str, Any] | None = None,
                rails: Sequence[str] | None = None) -> PowerSample:
    """A :class:`PowerSample` from one jtop reading: watts is jtop's total, or the sum of ``rails``."""
    reading = jtop_power(power)
    watts = reading.total_w if rails is None else select_rails(reading.rails_w, rails).total_watts(reading.rails_w)
    return PowerSample(t, watts, reading.rails_w, hottest_c(jtop_temperatures(temperature or {})))


class JtopMeter(SampledMeter):
    """Samples ``jtop().power`` every ``interval_s`` (jtop's own service interval may be slower: then
    consecutive samples repeat a reading). ``jtop_factory`` replaces ``jtop.jtop`` (tests)."""

    name = "jtop"

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 rails: Sequence[str] | None = None, jtop_factory: Callable[..., Any] | None = None) -> None:
        super().__init__(interval_s, clock)
        if jtop_factory is None:
            jtop_mod = require("jtop", "jetson")
            jtop_factory, failure = jtop_mod.jtop, jtop_mod.JtopException
        else:
            failure = RuntimeError
        self._explicit = tuple(rails) if rails is not None else None
        self._jetson = jtop_factory(interval=interval_s)
        try:
            self._jetson.start()
            first = jtop_power(self._jetson.power)
            how = select_rails(first.rails_w, self._explicit).reason if self._explicit else first.describe()
        except (failure, OSError, ValueError) as exc:  # no service, no sensors, or rails= it does not report
            self._close_jtop()
            raise SensorUnavailable("jtop: " + " ".join(str(exc).split())) from exc
        self._rails = list(self._explicit) if self._explicit else list(first.total_rails)
        service = getattr(self._jetson, "interval", interval_s)
        slower = f" (the jtop service runs every {service} s)" if service and service > interval_s else ""
        self.reason = f"jtop every {interval_s} s{slower}: {how}"

    @property
    def rails(self) -> list[str]:
        return list(self._rails)

    def _read(self) -> PowerSample:
        self._jetson.ok(spin=True)  # raises jtop's own error if its connection died
        return jtop_sample(self._jetson.power, self.clock(), self._jetson.temperature, self._explicit)

    def _close_jtop(self) -> None:
        if self._jetson is not None:
            self._jetson.close()
            self._jetson = None

    def close(self) -> None:
        super().close()
        self._close_jtop()
