"""RaplMeter: CPU package (and optionally DRAM) energy from the Linux powercap RAPL counters.

Layout (Linux ``Documentation/power/powercap/powercap.rst``): ``/sys/class/powercap/intel-rapl:<p>``
is package ``p`` (``name`` = ``package-<p>``), ``intel-rapl:<p>:<k>`` its sub-zones (``core``,
``uncore``, ``dram``); each has ``energy_uj`` (a cumulative counter, microjoules) that wraps to 0
after ``max_energy_range_uj``. AMD processors use the same tree (the ``intel_rapl`` driver's AMD
support; ``amd-rapl`` / ``amd_rapl`` zone prefixes are accepted too). ``intel-rapl-mmio`` duplicates
the package zone through MMIO and ``psys`` covers the whole platform: neither is added.

Joules are the sum of the counters' increases (source "counter"). A thread reads every
``interval_s``, so a counter cannot wrap twice unseen (about 262 kJ range: minutes at hundreds of
watts), and each reading gives a power sample (the increase over the interval just ended).
``energy_uj`` is root-only on kernels since 5.10 (CVE-2020-8694): a PermissionError is a reason.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edge.energy.meter import PowerSample, SampledMeter, SensorUnavailable, counter_delta

POWERCAP = Path("/sys/class/powercap")
_ZONE = re.compile(r"(intel-rapl|amd-rapl|amd_rapl):(\d+)(?::(\d+))?")


@dataclass(frozen=True)
class RaplZone:
    label: str  # "package-0", "package-0/dram"
    path: Path
    max_range_uj: int | None


def read_uj(path: Path) -> int:
    """One integer sysfs file (microjoules)."""
    return int(path.read_text().strip())


def find_zones(root: Path = POWERCAP, include_dram: bool = False) -> list[RaplZone]:
    """The package zones under ``root`` (and their ``dram`` sub-zones if asked), sorted.

    Raises:
        SensorUnavailable: no such tree, no package zone, or a package without a readable ``energy_uj``.
    """
    if not root.is_dir():
        raise SensorUnavailable(f"rapl: no {root} (no powercap driver, or not exposed here)")
    zones = []
    names = {}
    for d in sorted(root.iterdir()):
        m = _ZONE.fullmatch(d.name)
        if not m or not (d / "name").exists():
            continue
        name = (d / "name").read_text().strip()
        package = m.group(3) is None
        if package and name.startswith("package"):
            names[(m.group(1), m.group(2))] = name
            zones.append((d, name, m))
        elif not package and include_dram and name == "dram":
            zones.append((d, name, m))
    if not any(m.group(3) is None for _, _, m in zones):
        raise SensorUnavailable(f"rapl: {root} has no intel-rapl / amd-rapl package zone")
    out = []
    for d, name, m in zones:
        label = name if m.group(3) is None else f"{names.get((m.group(1), m.group(2)), d.name)}/{name}"
        energy = d / "energy_uj"
        if not energy.exists():
            raise SensorUnavailable(f"rapl: {d} has no energy_uj")
        max_file = d / "max_energy_range_uj"
        out.append(RaplZone(label, energy, read_uj(max_file) if max_file.exists() else None))
    return out


class RaplMeter(SampledMeter):
    """Sum of the package (and optionally DRAM) RAPL counters under ``root``."""

    name = "rapl"
    source = "counter"

    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 root: Path | str = POWERCAP, include_dram: bool = False,
                 read: Callable[[Path], int] = read_uj) -> None:
        super().__init__(interval_s, clock)
        self.root, self._read_uj = Path(root), read
        self.zones = find_zones(self.root, include_dram)
        self._state_lock = threading.Lock()
        self._prev: tuple[float, list[int]] = (self.clock(), self._counters())  # also checks readability
        self._window_uj = 0
        self.reason = (f"rapl: energy counters of {' + '.join(z.label for z in self.zones)} (CPU side only: "
                       f"not the GPU, not the whole machine), read every {interval_s} s")

    @property
    def rails(self) -> list[str]:
        return [z.label for z in self.zones]

    def _counters(self) -> list[int]:
        try:
            return [self._read_uj(z.path) for z in self.zones]
        except PermissionError as exc:
            raise SensorUnavailable(f"rapl: {exc.filename or exc} is not readable by this user (root-only since "
                                    "Linux 5.10, CVE-2020-8694): run as root or grant read access") from exc

    def _advance(self) -> tuple[float, dict[str, float]]:
        """Read the counters; add the increases to the window; (t, watts per zone over the last interval)."""
        with self._state_lock:
            t, now = self.clock(), self._counters()
            t_prev, prev = self._prev
            deltas = [counter_delta(a, b, z.max_range_uj) for a, b, z in zip(prev, now, self.zones)]
            self._prev = (t, now)
            self._window_uj += sum(deltas)
        dt = t - t_prev
        return t, {z.label: (d / 1e6 / dt if dt > 0 else 0.0) for z, d in zip(self.zones, deltas)}

    def _read(self) -> PowerSample:
        t, watts = self._advance()
        return PowerSample(t, sum(watts.values()), watts)

    def _start(self) -> None:
        with self._state_lock:
            self._prev = (self.clock(), self._counters())  # the window's baseline; its first sample is the next read
            self._window_uj = 0
        self._samples = []
        self._error = None
        self._stop_evt.clear()
        self._thread = threading.Thread(target=self._loop, name="rapl-meter", daemon=True)
        self._thread.start()

    def _stop(self) -> tuple[float | None, str | None, list[PowerSample]]:
        _, source, samples = super()._stop()  # joins the thread, takes a last reading
        return self._window_uj / 1e6, source, samples
