"""jtop: the conversion of ``jtop().power`` on the project's own Orin Nano property dump
(tests/fixtures/jtop, written by hand in jetson-stats 4.x's shapes; runs on every clone), on the real
(unsourced) Orin Nano dump in ../shared where it exists (skipped, naming the file, where it does not), and
on SYNTHETIC dicts shaped like jetson-stats 4.x-7.x output (``jtop/core/power.py``: ``total_power``);
the meter against a stand-in jtop object (the jtop service cannot run off a Jetson; the live path is
``tests/jetson/test_jtop_live.py``)."""
from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from edge.core.errors import SmartExitError
from edge.energy.jtop import JtopMeter, jtop_power, jtop_sample, jtop_temperatures
from edge.energy.meter import SensorUnavailable
from edge.energy.rails import AGX_ORIN_SUMMED
from tests.unit.edge.energy.shared_fixtures import JTOP, PROJECT_JTOP, skip_without

PROJECT_DUMP = PROJECT_JTOP / "orin_nano_jp6_jtop_properties.txt"  # written by this project
DUMP = JTOP / "orin_nano_4gb_super_jp6.2_jtop_properties_unsourced.txt"  # real, read in place


def dump_text(path: Path, name: str) -> str:
    """``print(jetson.<name>)`` from a property dump: the line after the ``jetson.<name>`` header."""
    lines = path.read_text().splitlines()
    return lines[lines.index(f"jetson.{name}") + 1]


def dump_property(path: Path, name: str):
    return ast.literal_eval(dump_text(path, name))


def test_orin_nano_dump():
    power = dump_property(PROJECT_DUMP, "power")
    p = jtop_power(power)
    # VDD_IN sits in 'tot' with its name: the total is that rail, 7020 mW, not 7020 + 2010 + 1730
    assert not p.total_is_sum and p.total_rails == ("VDD_IN",) and p.total_w == pytest.approx(7.020)
    assert p.rails_w == pytest.approx({"VDD_CPU_GPU_CV": 2.010, "VDD_SOC": 1.730, "VDD_IN": 7.020})
    assert p.describe() == "jtop's total: VDD_IN, the input rail"
    assert dump_property(PROJECT_DUMP, "stats")["Power TOT"] == 7020  # jtop's own stats name the same total
    temps = jtop_temperatures(dump_property(PROJECT_DUMP, "temperature"))
    assert set(temps) == {"cpu", "gpu", "soc0", "soc1", "soc2", "tj"}  # cv0-2 offline (-256, online False)
    s = jtop_sample(power, 3.25, dump_property(PROJECT_DUMP, "temperature"))
    assert (s.t, s.watts, s.temperature_c) == (3.25, pytest.approx(7.020), 51.25)
    # rails= sums the named parts instead (what the meter does when asked for them): 2010 + 1730 mW
    assert jtop_sample(power, 0.0, rails=["VDD_CPU_GPU_CV", "VDD_SOC"]).watts == pytest.approx(3.740)


def test_real_orin_nano_dump():
    skip_without(DUMP)
    power = dump_property(DUMP, "power")
    p = jtop_power(power)
    # jtop moved VDD_IN out of 'rail' into 'tot' and named it: the total is that rail, 5133 mW
    assert not p.total_is_sum and p.total_rails == ("VDD_IN",) and p.total_w == pytest.approx(5.133)
    assert p.rails_w == pytest.approx({"VDD_CPU_GPU_CV": 1.064, "VDD_SOC": 1.540, "VDD_IN": 5.133})
    assert "VDD_IN, the input rail" in p.describe()
    assert "'Power TOT': 5133," in dump_text(DUMP, "stats")  # jtop's own stats agree (a repr with datetimes)
    temps = jtop_temperatures(dump_property(DUMP, "temperature"))
    assert "cv0" not in temps and temps["tj"] == 47.906  # cv0-2 offline (-256)
    s = jtop_sample(power, 12.5, dump_property(DUMP, "temperature"))
    assert (s.t, s.watts, s.temperature_c) == (12.5, pytest.approx(5.133), 47.906)


# SYNTHETIC: AGX Orin on JetPack 6 (R36.4) as jetson-stats 4.x/7.x shapes it: no input rail, so 'tot'
# is the unnamed sum of the three rails (2797 + 799 + 3215 = 6811 mW)
AGX_JP6 = {"rail": {"VDD_GPU_SOC": {"volt": 5000, "curr": 559, "power": 2797, "online": True, "avg": 2797},
                    "VDD_CPU_CV": {"volt": 5000, "curr": 160, "power": 799, "online": True, "avg": 799},
                    "VIN_SYS_5V0": {"volt": 5000, "curr": 643, "power": 3215, "online": True, "avg": 3215}},
           "tot": {"power": 6811, "avg": 6811}}
# SYNTHETIC: AGX Orin on JetPack 5, where the kernel also lists VDDQ_VDD2_1V8AO: jtop adds it (7112 mW)
AGX_JP5 = {"rail": {**AGX_JP6["rail"], "VDDQ_VDD2_1V8AO": {"power": 301, "avg": 301, "online": True}},
           "tot": {"power": 7112, "avg": 7112}}


def test_synthetic_agx_orin_sum():
    p = jtop_power(AGX_JP6)
    assert p.total_is_sum and p.total_w == pytest.approx(6.811)
    assert set(p.total_rails) == set(AGX_ORIN_SUMMED)
    assert "not the board's input power" in p.describe() and "does not add" not in p.describe()
    jp5 = jtop_power(AGX_JP5)
    assert jp5.total_w == pytest.approx(7.112) and "VDDQ_VDD2_1V8AO, which the tegrastats meter does not add" in \
        jp5.describe()
    # rails= sums the named rails instead: the tegrastats rule, 6811 mW
    assert jtop_sample(AGX_JP5, 0.0, rails=AGX_ORIN_SUMMED).watts == pytest.approx(6.811)


@pytest.mark.parametrize("power, match", [
    ({}, "no power sensors"),
    ({"rail": {}, "total": {}}, "not a jetson-stats >= 4 power dict"),  # SYNTHETIC: an unknown shape
    ({"rail": {"A": {"avg": 1}}, "tot": {"power": 1, "avg": 1}}, "rail A: expected a dict with a numeric 'power'"),
    ({"rail": {"A": {"power": 1000}, "B": {"power": 500}}, "tot": {"power": 1400}}, "not the sum of its rails"),
    ({"rail": {}, "tot": {"power": 1400}}, "no rails it could sum"),
])
def test_synthetic_malformed(power, match):
    with pytest.raises(ValueError, match=match):
        jtop_power(power)


class FakeJtop:
    """A stand-in for ``jtop.jtop`` (a mock of a service that cannot run here): it serves the
    SYNTHETIC AGX Orin reading with the GPU rail rising 1 W per read."""

    def __init__(self, interval: float, fail: str | None = None) -> None:
        self.requested, self.fail, self.reads, self.closed = interval, fail, 0, False
        self.interval = 0.5  # the service's own interval (another client set it)

    def start(self) -> None:
        if self.fail:
            raise RuntimeError(self.fail)

    def ok(self, spin: bool = False) -> bool:
        return True

    @property
    def power(self):
        self.reads += 1
        gpu = 2797 + 1000 * self.reads
        rails = {**AGX_JP6["rail"], "VDD_GPU_SOC": {"power": gpu, "avg": gpu}}
        return {"rail": rails, "tot": {"power": gpu + 799 + 3215, "avg": 0}}

    temperature = {"tj": {"temp": 50.0, "online": True}, "cv0": {"temp": -256, "online": False}}

    def close(self) -> None:
        self.closed = True


def test_meter_over_a_stand_in_jtop():
    made = []
    meter = JtopMeter(0.01, jtop_factory=lambda interval: made.append(FakeJtop(interval)) or made[-1])
    assert made[0].requested == 0.01
    assert meter.rails == sorted(AGX_ORIN_SUMMED) and "the jtop service runs every 0.5 s" in meter.reason
    meter.start()
    time.sleep(0.05)
    m = meter.stop()
    meter.close()
    assert made[0].closed and m.source == "samples" and m.meter == "jtop"
    # each read adds 1 W to the GPU rail: watts are jtop's total (2797 + 1000 k + 799 + 3215 mW)
    assert [s.watts for s in m.samples] == pytest.approx([6.811 + k for k in range(2, 2 + len(m.samples))])
    assert m.samples[0].rails["VDD_GPU_SOC"] == pytest.approx(4.797) and m.samples[0].temperature_c == 50.0
    ts = [s.t for s in m.samples]
    hand = sum((ts[i] - ts[i - 1]) * (m.samples[i].watts + m.samples[i - 1].watts) / 2 for i in range(1, len(ts)))
    assert m.joules == pytest.approx(hand)


def test_meter_with_named_rails():
    meter = JtopMeter(0.01, rails=["VDD_CPU_CV"], jtop_factory=lambda interval: FakeJtop(interval))
    meter.start()
    m = meter.stop()
    meter.close()
    assert m.rails == ["VDD_CPU_CV"] and all(s.watts == pytest.approx(0.799) for s in m.samples)


def test_rails_it_does_not_report_are_a_reason():
    with pytest.raises(SensorUnavailable, match=r"^jtop: rails to sum \['VDD_IN'\]: \['VDD_IN'\] not among"):
        JtopMeter(0.1, rails=["VDD_IN"], jtop_factory=lambda interval: FakeJtop(interval))


def test_service_not_running_is_a_reason():
    msg = "The jtop.service is not active. Please run:\nsudo jtop --install-service"
    with pytest.raises(SensorUnavailable, match="^jtop: The jtop.service is not active. Please run: sudo jtop"):
        JtopMeter(0.1, jtop_factory=lambda interval: FakeJtop(interval, fail=msg))


def test_a_reading_failing_mid_window_is_raised():
    class Dying(FakeJtop):
        def ok(self, spin: bool = False) -> bool:
            if self.reads >= 2:
                raise RuntimeError("Lost connection with jtop server")
            return True

    meter = JtopMeter(0.01, jtop_factory=lambda interval: Dying(interval))
    meter.start()
    time.sleep(0.1)
    with pytest.raises(SmartExitError, match="Lost connection"):
        meter.stop()
    meter.close()
