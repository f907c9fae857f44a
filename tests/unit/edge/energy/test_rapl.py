"""RAPL on powercap trees built in tmp_path (the layout of Linux's Documentation/power/powercap):
package zones, sub-zones that are not added, wrap-around, two packages, unreadable counters."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from edge.core.errors import ConfigError
from edge.energy.detect import open_meter
from edge.energy.meter import SensorUnavailable
from edge.energy.rapl import RaplMeter, find_zones, read_uj

MAX = 262_143_328_850  # a common max_energy_range_uj (2^32 counts of 61.035 uJ)


def zone(root: Path, dirname: str, name: str, energy: int | None = 0, max_range: int | None = MAX) -> Path:
    d = root / dirname
    d.mkdir(parents=True)
    (d / "name").write_text(name + "\n")
    if energy is not None:
        (d / "energy_uj").write_text(f"{energy}\n")
    if max_range is not None:
        (d / "max_energy_range_uj").write_text(f"{max_range}\n")
    return d


def set_uj(d: Path, value: int) -> None:
    """Replace the counter atomically, as sysfs serves it (a plain rewrite could be read half-written)."""
    tmp = d / "energy_uj.tmp"
    tmp.write_text(f"{value}\n")
    os.replace(tmp, d / "energy_uj")


@pytest.fixture
def tree(tmp_path) -> dict[str, Path]:
    root = tmp_path / "powercap"
    return {
        "root": root,
        "p0": zone(root, "intel-rapl:0", "package-0", 1_000_000),
        "core0": zone(root, "intel-rapl:0:0", "core", 500),
        "dram0": zone(root, "intel-rapl:0:1", "dram", 2_000),
        "p1": zone(root, "intel-rapl:1", "package-1", 7_000_000),
        "mmio": zone(root, "intel-rapl-mmio:0", "package-0", 1_000_000),  # the same package again: not added
        "psys": zone(root, "intel-rapl:2", "psys", 9_000_000),  # the whole platform: not added
    }


def test_zones(tree):
    assert [z.label for z in find_zones(tree["root"])] == ["package-0", "package-1"]
    assert [z.label for z in find_zones(tree["root"], include_dram=True)] == ["package-0", "package-0/dram",
                                                                              "package-1"]
    assert all(z.max_range_uj == MAX for z in find_zones(tree["root"]))


def test_amd_prefix(tmp_path):
    zone(tmp_path, "amd-rapl:0", "package-0", 5)
    assert [z.label for z in find_zones(tmp_path)] == ["package-0"]


def test_two_packages_and_a_wrap_in_one_window(tree):
    meter = RaplMeter(3600.0, root=tree["root"], include_dram=True)  # no read between start and stop
    set_uj(tree["p0"], MAX - 100)
    set_uj(tree["dram0"], 2_000)
    set_uj(tree["p1"], 7_000_000)
    meter.start()
    set_uj(tree["p0"], 50)  # wrapped: MAX - (MAX - 100) + 50 + 1 = 151 uJ
    set_uj(tree["dram0"], 3_000)  # +1000 uJ
    set_uj(tree["p1"], 9_500_000)  # +2 500 000 uJ
    m = meter.stop()
    meter.close()
    assert m.source == "counter" and m.rails == ["package-0", "package-0/dram", "package-1"]
    assert m.joules == pytest.approx((151 + 1_000 + 2_500_000) / 1e6)
    (s,) = m.samples  # the reading at stop: each zone's increase over the window, as watts
    assert s.watts == pytest.approx(sum(s.rails.values()))


def wait_reads(meter: RaplMeter, n: int) -> None:
    """Wait until the thread has taken ``n`` more readings (the second begins after any write)."""
    seen = 0
    last = meter.latest()
    deadline = time.monotonic() + 5
    while seen < n:
        assert time.monotonic() < deadline, "the sampling thread took no reading"
        cur = meter.latest()
        if cur is not last:
            seen, last = seen + 1, cur
        time.sleep(0.001)


def test_the_thread_sees_every_wrap(tree):
    """Two wraps in one window: reading only at start and stop would see one (201 uJ); the thread's
    readings every interval count both."""
    meter = RaplMeter(0.005, root=tree["root"])
    set_uj(tree["p0"], MAX - 100)
    meter.start()
    for value in (100, MAX - 100, 100):  # +201, +(MAX - 200), +201 uJ
        set_uj(tree["p0"], value)
        wait_reads(meter, 2)
    m = meter.stop()
    meter.close()
    assert m.joules == pytest.approx((201 + (MAX - 200) + 201) / 1e6)
    assert len(m.samples) >= 6


def test_power_samples_from_deltas(tree):
    t = iter([0.0, 0.0, 10.0, 12.0, 12.0])  # __init__'s reading, start(), the baseline, stop(), the last reading
    meter = RaplMeter(3600.0, clock=lambda: next(t), root=tree["root"])
    meter.start()  # baseline at t = 10
    set_uj(tree["p0"], 1_000_000 + 30_000_000)  # +30 J over 2 s: 15 W
    set_uj(tree["p1"], 7_000_000 + 10_000_000)  # +10 J: 5 W
    m = meter.stop()
    meter.close()
    (s,) = m.samples
    assert s.t == 12.0 and s.rails == pytest.approx({"package-0": 15.0, "package-1": 5.0}) and s.watts == 20.0
    assert m.joules == pytest.approx(40.0)


def test_missing_or_unreadable_counters(tmp_path, tree):
    with pytest.raises(SensorUnavailable, match="^rapl: no .*not-there"):
        find_zones(tmp_path / "not-there")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SensorUnavailable, match="has no intel-rapl / amd-rapl package zone"):
        find_zones(tmp_path / "empty")
    zone(tmp_path / "broken", "intel-rapl:0", "package-0", energy=None)
    with pytest.raises(SensorUnavailable, match="intel-rapl:0 has no energy_uj"):
        RaplMeter(root=tmp_path / "broken")

    def root_only(path: Path) -> int:  # what a non-root user meets on Linux >= 5.10 (we may run as root)
        if path.name == "energy_uj" and path.parent.name == "intel-rapl:1":
            raise PermissionError(13, "Permission denied", str(path))
        return read_uj(path)

    with pytest.raises(SensorUnavailable, match=r"intel-rapl:1/energy_uj is not readable by this user"):
        RaplMeter(root=tree["root"], read=root_only)


def test_through_detect(tree, tmp_path):
    meter = open_meter("rapl", 0.05, root=tree["root"])
    assert meter.name == "rapl" and "CPU side only" in meter.reason
    meter.close()
    with pytest.raises(ConfigError, match="power meter rapl is not available: rapl: no "):
        open_meter("rapl", root=tmp_path / "nothing")
