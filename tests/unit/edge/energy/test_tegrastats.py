"""tegrastats: the parser on every line of the project's own fixtures (tests/fixtures/tegrastats, written
by hand in the layouts of AGX Orin JetPack 5 / 6 / 7, Orin NX, Thor and the JetPack 4 Nano; each file's
header says what it models), the rail rule per board, the integral of a logged window computed by hand,
and the meter against a stand-in tegrastats. These run on every clone.

The same checks on real device captures (../shared, never copied here) are in
``test_tegrastats_captures.py`` and skip where those files are absent. Lines written in this file are
SYNTHETIC and say so. The stand-in tegrastats is a small script written here that accepts tegrastats'
command line and writes lines to ``--logfile``: it exercises the real spawn / tail / stop path without a
Jetson.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from edge.core.errors import SmartExitError
from edge.energy.meter import SensorUnavailable
from edge.energy.rails import AGX_ORIN_SUMMED, RailLayout, select_rails
from edge.energy.tegrastats import (
    LineFormat,
    TegrastatsMeter,
    TegrastatsParseError,
    interval_ms,
    parse_line,
    parse_lines,
    tegrastats_argv,
    window_joules,
)
from tests.unit.edge.energy.shared_fixtures import PROJECT_TEGRASTATS, fixture_lines

# The rail rule each board gets: the AGX Orin sum of three rails, the module input VDD_IN alone, or refused.
AGX = "agx"
MODULE = "module_input"
REFUSED = "refused"
# Which rule each project fixture gets, and its line format (the file headers say which board each models).
PROJECT_LAYOUT = {
    "agx_orin_jp5.log": (AGX, LineFormat.TWO_VALUE),
    "agx_orin_jp6.log": (AGX, LineFormat.TWO_VALUE),
    "agx_orin_jp6_window.log": (AGX, LineFormat.TWO_VALUE),
    "agx_orin_jp7_three_value.log": (AGX, LineFormat.THREE_VALUE),
    "orin_nx_jp6.log": (MODULE, LineFormat.TWO_VALUE),
    "thor_r38.log": (REFUSED, LineFormat.TWO_VALUE),
    "nano_jp4_legacy.log": (REFUSED, LineFormat.LEGACY_NO_UNITS),
}


def check_line(line: str, where: str, layout: str, expected_format: LineFormat) -> None:
    """What every tegrastats line must give: rails, RAM, its format, a timestamp exactly where the line
    starts with one, plausible temperatures (-256C offline sentinels left out), no NC channel, and the
    total by the board's rail rule (or a refusal)."""
    r = parse_line(line)
    assert r.rails and 0 < r.ram_used_mb <= r.ram_total_mb, where
    assert r.format is expected_format, where
    assert (r.timestamp is None) == (not line[:1].isdigit()), where
    assert all(-40 < c < 125 for c in r.temperatures_c.values()), where
    assert r.gpu_util_pct is None or 0 <= r.gpu_util_pct <= 100, where
    assert all(math.isfinite(p.now_w) and math.isfinite(p.mean_w) for p in r.rails.values()), where
    assert "NC" not in r.rails, where
    if layout == REFUSED:
        with pytest.raises(ValueError, match="unknown Jetson rail layout"):
            select_rails(r.rails)
        return
    sel = select_rails(r.rails)
    if layout == AGX:
        assert sel.layout is RailLayout.AGX_ORIN_SUM and sel.rails == AGX_ORIN_SUMMED, where
        assert "not the board's input power" in sel.reason
        assert sel.total_watts(r.watts()) == pytest.approx(sum(r.rails[k].now_w for k in AGX_ORIN_SUMMED))
    else:
        assert sel.layout is RailLayout.MODULE_INPUT and sel.rails == ("VDD_IN",), where
        assert sel.total_watts(r.watts()) == r.rails["VDD_IN"].now_w


def lines_of(name: str) -> list[str]:
    return fixture_lines(PROJECT_TEGRASTATS / name)


def record(name: str, n: int):
    """Line ``n`` (1-based, header not counted) of project fixture ``name``, parsed."""
    return parse_line(lines_of(name)[n - 1])


def test_every_project_fixture_is_classified():
    assert {p.name for p in PROJECT_TEGRASTATS.glob("*.log")} == set(PROJECT_LAYOUT), \
        "a new fixture file: classify it in PROJECT_LAYOUT"


@pytest.mark.parametrize("name", sorted(PROJECT_LAYOUT))
def test_every_project_line_parses(name):
    lines = lines_of(name)
    assert lines, f"{name} holds no tegrastats line"
    layout, fmt = PROJECT_LAYOUT[name]
    for n, line in enumerate(lines, 1):
        check_line(line, f"{name}:{n}", layout, fmt)


def test_jetpack5_agx_orin_line_by_hand():
    r = record("agx_orin_jp5.log", 1)
    assert r.timestamp == datetime(2023, 3, 2, 9, 15, 40)
    assert (r.ram_used_mb, r.ram_total_mb) == (2048, 62795)
    # 6 power entries, two NC: VDD_GPU_SOC 2400 + VDD_CPU_CV 600 + VIN_SYS_5V0 4000 = 7000 mW;
    # VDDQ_VDD2_1V8AO 300 mW reported, not added
    assert set(r.rails) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert r.rails["VDDQ_VDD2_1V8AO"].now_w == pytest.approx(0.300)
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(7.0)
    assert r.offline_sensors == ("CV0", "CV1", "GPU", "CV2")  # printed as -256C
    assert r.temperatures_c["CPU"] == 41.5 and r.temperatures_c["Tboard"] == 31.0 and r.temperatures_c["tj"] == 41.5
    assert r.gpu_util_pct == 0.0
    busy = record("agx_orin_jp5.log", 2)  # the GPU zone back online, GR3D_FREQ 35%@1300
    assert busy.offline_sensors == ("CV0", "CV1", "CV2") and busy.temperatures_c["GPU"] == 40.25
    assert busy.gpu_util_pct == 35.0 and select_rails(busy.rails).total_watts(busy.watts()) == pytest.approx(8.2)


def test_jetpack6_negative_zero_and_untimed_lines_by_hand():
    r = record("agx_orin_jp6.log", 1)  # JetPack 6.0: lower-case, tboard/tdiode
    assert r.rails["VDD_CPU_CV"].now_w == pytest.approx(-0.400)
    assert r.temperatures_c["tboard"] == 27.0 and r.temperatures_c["tdiode"] == 27.5
    # 1600 - 400 + 2600 = 3800 mW: the negative reading is kept as read
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(3.8)
    zero = record("agx_orin_jp6.log", 2)
    assert zero.rails["VDD_CPU_CV"].now_w == 0.0
    assert select_rails(zero.rails).total_watts(zero.watts()) == pytest.approx(2.0 + 2.5)
    untimed = record("agx_orin_jp6.log", 3)
    assert untimed.timestamp is None and untimed.gpu_util_pct == 48.0
    # VDD_GPU_SOC 3200 + VDD_CPU_CV 400 + VIN_SYS_5V0 4300 = 7900 mW
    assert select_rails(untimed.rails).total_watts(untimed.watts()) == pytest.approx(7.9)
    assert all(r.timestamp is None for r in parse_lines(lines_of("nano_jp4_legacy.log")))


def test_second_figure_is_kept_apart_from_the_first():
    r = record("agx_orin_jp6.log", 2)
    assert (r.rails["VIN_SYS_5V0"].now_w, r.rails["VIN_SYS_5V0"].mean_w) == (2.5, 2.55)
    nx = record("orin_nx_jp6.log", 2)
    assert (nx.rails["VDD_IN"].now_w, nx.rails["VDD_IN"].mean_w) == (8.0, 10.25)
    assert select_rails(nx.rails).total_watts(nx.watts()) == 8.0  # the instantaneous figure


def test_jetpack7_three_values_by_hand():
    r = record("agx_orin_jp7_three_value.log", 1)
    assert r.format is LineFormat.THREE_VALUE
    assert r.rails["VDD_GPU_SOC"].max_w == pytest.approx(5.1)
    assert r.temperatures_c["cpu"] == 52.5 and r.gpu_util_pct == 15.0  # 'cpu@52.5C/53C': the current figure
    # 5100 + 3300 + 5500 = 13900 mW
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(13.9)
    later = record("agx_orin_jp7_three_value.log", 2)  # the GPU rail drops; the third figure keeps the max
    assert (later.rails["VDD_GPU_SOC"].now_w, later.rails["VDD_GPU_SOC"].mean_w,
            later.rails["VDD_GPU_SOC"].max_w) == (2.3, 3.7, 5.1)
    assert select_rails(later.rails).total_watts(later.watts()) == pytest.approx(2.3 + 1.1 + 4.7)


def test_module_input_is_used_alone():
    r = record("orin_nx_jp6.log", 1)
    # VDD_IN 12500 mW alone, not 12500 + 4700 + 2800
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(12.5)
    assert r.gpu_util_pct == 60.0 and r.offline_sensors == ("cv0", "cv1", "cv2")


def test_negative_fixtures_refused_or_flagged():
    thor = record("thor_r38.log", 1)
    assert thor.gpu_util_pct is None  # "GR3D_FREQ @[0,0,0]": no percentage
    assert thor.rails["VDD_CPU_SOC_MSS"].now_w == pytest.approx(4.2)
    with pytest.raises(ValueError, match=r"unknown Jetson rail layout \['VDD_CPU_SOC_MSS', 'VDD_GPU', 'VIN_SYS_5V0'\]"):
        select_rails(thor.rails)
    nano = record("nano_jp4_legacy.log", 2)
    assert nano.format is LineFormat.LEGACY_NO_UNITS
    assert (nano.rails["POM_5V_IN"].now_w, nano.rails["POM_5V_IN"].mean_w) == (2.0, 1.5)
    with pytest.raises(ValueError, match="POM_5V_IN"):
        select_rails(nano.rails)


def test_timestamps_that_skip_seconds():
    recs = parse_lines(lines_of("agx_orin_jp6_window.log"))
    gaps = [(b.timestamp - a.timestamp).total_seconds() for a, b in zip(recs, recs[1:])]
    assert gaps == [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]  # 10:20:09 -> 10:20:11 (the header says so)


def test_integral_over_a_logged_window():
    # totals (mW) at :07 6000, :08 9000, :09 12000, :11 12000, :12 10000, :13 6000.
    # start :07.500 -> 6000 + 0.5 * (9000 - 6000) = 7500; end :12.250 -> 10000 - 0.25 * (10000 - 6000) = 9000
    # 0.5 * (7500 + 9000) / 2 + (9000 + 12000) / 2 + 2 * 12000 + (12000 + 10000) / 2 + 0.25 * (10000 + 9000) / 2
    # = 4125 + 10500 + 24000 + 11000 + 2375 = 52000 mJ
    recs = parse_lines(lines_of("agx_orin_jp6_window.log"))
    window = json.loads((PROJECT_TEGRASTATS / "agx_orin_jp6_window.window.json").read_text())
    start, end = (datetime.fromisoformat(window[k]) for k in ("start_time", "end_time"))
    sel = select_rails(recs[0].rails)
    assert window_joules(recs, sel, start, end) == pytest.approx(52.0, rel=1e-12)
    with pytest.raises(ValueError, match="not inside the log"):
        window_joules(recs, sel, start.replace(hour=9), end)
    with pytest.raises(ValueError, match="needs timestamped lines"):  # agx_orin_jp6.log line 3 has none
        window_joules(parse_lines(lines_of("agx_orin_jp6.log")), sel, start, end)


# ---- SYNTHETIC lines (hand-written, not captured from a device) for the error paths ----
SYN_ORIN = ("RAM 1000/62841MB (lfb 2x4MB) CPU [1%@729] GR3D_FREQ 5% cpu@40C tj@41C "
            "VDD_GPU_SOC 1000mW/1000mW VDD_CPU_CV 500mW/500mW VIN_SYS_5V0 2000mW/2000mW")


@pytest.mark.parametrize("line, match", [
    ("", "empty"),
    ("CPU [1%@729] VDD_IN 100mW/100mW", "no 'RAM"),
    ("RAM 1/2MB CPU [1%@729]", "no power rail"),
    ("RAM 1/2MB VDD_IN 100mW/100mW VDD_IN 200mW/200mW", "appears twice"),
    ("RAM 1/2MB VDD_IN 100mW/100mW/100mW VDD_SOC 50mW/50mW", "mixed formats"),
    ("RAM 1/2MB VDD_IN 100mW/100mW VDD_SOC 5W/50mW 7mW", "unrecognised power field"),
    ("13-45-2025 10:00:00 RAM 1/2MB VDD_IN 100mW/100mW", "bad timestamp"),
])
def test_synthetic_bad_lines(line, match):
    with pytest.raises(TegrastatsParseError, match=match):
        parse_line(line)


def test_synthetic_rail_rules():
    r = parse_line(SYN_ORIN)
    assert select_rails(r.rails).total_watts(r.watts()) == 3.5
    partial = parse_line(SYN_ORIN.replace(" VIN_SYS_5V0 2000mW/2000mW", ""))
    with pytest.raises(ValueError, match="unknown Jetson rail layout"):  # a missing rail is not summed away
        select_rails(partial.rails)
    explicit = select_rails(r.rails, ["VDD_GPU_SOC"])
    assert explicit.layout is RailLayout.EXPLICIT and explicit.total_watts(r.watts()) == 1.0
    with pytest.raises(ValueError, match="not among the reported rails"):
        select_rails(r.rails, ["VDD_IN"])
    with pytest.raises(ValueError, match="rails .* missing"):
        explicit.total_watts({"VDD_CPU_CV": 1.0})
    with pytest.raises(TegrastatsParseError, match="line 2"):
        parse_lines([SYN_ORIN, "garbage"])


def test_command_line():
    assert tegrastats_argv(0.1, Path("/tmp/t.log")) == ["tegrastats", "--interval", "100", "--logfile", "/tmp/t.log"]
    assert tegrastats_argv(0.0004, "x.log", "/usr/bin/tegrastats") == ["/usr/bin/tegrastats", "--interval", "1",
                                                                       "--logfile", "x.log"]
    assert interval_ms(1.0) == 1000


# ---- the meter, against a stand-in tegrastats (a script; a real Jetson runs the real one) ----
FAKE = """#!{python}
import os, sys, time
args = sys.argv[1:]
assert args[0] == "--interval" and args[2] == "--logfile" and len(args) == 4, args
with open(os.environ["FAKE_TEGRASTATS_PIDS"], "a") as f:
    f.write(f"{{os.getpid()}}\\n")
src = os.environ["FAKE_TEGRASTATS_LINES"]
lines = [l for l in open(src).read().splitlines() if l.strip()]
if os.environ.get("FAKE_TEGRASTATS_EXIT"):
    print("stand-in tegrastats: asked to fail")
    sys.exit(3)
i = 0
with open(args[3], "a") as log:
    while True:
        log.write(lines[i % len(lines)] + "\\n")
        log.flush()
        i += 1
        time.sleep(int(args[1]) / 1000)
"""


@pytest.fixture
def fake_tegrastats(tmp_path, monkeypatch):
    script = tmp_path / "tegrastats"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_TEGRASTATS_PIDS", str(pids))

    def use(lines_file: Path) -> str:
        monkeypatch.setenv("FAKE_TEGRASTATS_LINES", str(lines_file))
        return str(script)

    use.pids = pids  # type: ignore[attr-defined]
    return use


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_meter_integrates_a_constant_synthetic_line(fake_tegrastats, tmp_path):
    src = tmp_path / "synthetic.log"  # SYNTHETIC: one Orin NX-style line, VDD_IN 5000 mW, repeated
    src.write_text("RAM 1/2MB GR3D_FREQ 0% tj@40C VDD_IN 5000mW/5000mW VDD_CPU_GPU_CV 1mW/1mW VDD_SOC 1mW/1mW\n")
    meter = TegrastatsMeter(0.02, binary=fake_tegrastats(src), log_dir=tmp_path / "logs")
    try:
        assert meter.rails == ["VDD_IN"] and "module input" in meter.reason
        meter.start()
        time.sleep(0.3)
        m = meter.stop()
    finally:
        meter.close()
    assert m.source == "samples" and m.available and len(m.samples) >= 3
    # constant 5 W from the window's first line to the stop instant: 5 W * seconds (seconds is taken a
    # few microseconds before the stop instant the integral ends at)
    assert m.joules == pytest.approx(5.0 * m.seconds, rel=1e-3)
    assert meter.latest().temperature_c == 40.0
    pids = [int(p) for p in fake_tegrastats.pids.read_text().split()]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)  # the probe's process and the window's: stopped


def test_meter_replays_an_agx_orin_log(fake_tegrastats, tmp_path):
    src = tmp_path / "replay.log"  # the project's AGX Orin capture without its '#' header, as tegrastats prints it
    src.write_text("\n".join(lines_of("agx_orin_jp6_window.log")) + "\n")
    meter = TegrastatsMeter(0.02, binary=fake_tegrastats(src), probe=False)
    meter.start()
    time.sleep(0.1)
    m = meter.stop()
    meter.close()
    assert m.rails == list(AGX_ORIN_SUMMED) and "not the board's input power" in m.reason
    # the log's first three lines: 2000 + 500 + 3500, 4000 + 1000 + 4000, 6000 + 1500 + 4500 mW
    assert [s.watts for s in m.samples[:3]] == pytest.approx([6.0, 9.0, 12.0])
    assert all(b.t >= a.t for a, b in zip(m.samples, m.samples[1:]))


def test_meter_refuses_an_unknown_board(fake_tegrastats, tmp_path):
    src = tmp_path / "thor.log"  # the project's Thor line without its header
    src.write_text("\n".join(lines_of("thor_r38.log")) + "\n")
    with pytest.raises(SensorUnavailable, match="unknown Jetson rail layout"):
        TegrastatsMeter(0.02, binary=fake_tegrastats(src))
    pids = [int(p) for p in fake_tegrastats.pids.read_text().split()]
    assert pids and not any(_alive(p) for p in pids)


def test_meter_refuses_jetpack4_lines(fake_tegrastats, tmp_path):
    src = tmp_path / "nano.log"  # the project's JetPack 4 Nano lines without their header
    src.write_text("\n".join(lines_of("nano_jp4_legacy.log")) + "\n")
    with pytest.raises(SensorUnavailable, match="JetPack 4 tegrastats .* not supported"):
        TegrastatsMeter(0.02, binary=fake_tegrastats(src))


def test_meter_reports_a_failing_tegrastats(fake_tegrastats, tmp_path, monkeypatch):
    src = tmp_path / "synthetic.log"  # SYNTHETIC
    src.write_text(SYN_ORIN + "\n")
    monkeypatch.setenv("FAKE_TEGRASTATS_EXIT", "1")
    with pytest.raises(SensorUnavailable, match="exited with code 3.*asked to fail"):
        TegrastatsMeter(0.02, binary=fake_tegrastats(src))
    with pytest.raises(SensorUnavailable, match="not found on PATH"):
        TegrastatsMeter(0.02, binary="definitely-not-tegrastats-xyz")


def test_meter_can_start_again_after_a_failed_start(fake_tegrastats, tmp_path, monkeypatch):
    src = tmp_path / "synthetic.log"  # SYNTHETIC
    src.write_text(SYN_ORIN + "\n")
    meter = TegrastatsMeter(0.02, binary=fake_tegrastats(src), probe=False)
    monkeypatch.setenv("FAKE_TEGRASTATS_EXIT", "1")
    with pytest.raises(SmartExitError, match="exited"):
        meter.start()
    monkeypatch.delenv("FAKE_TEGRASTATS_EXIT")
    meter.start()
    m = meter.stop()
    meter.close()
    assert m.joules is not None and m.joules >= 0 and m.rails == list(AGX_ORIN_SUMMED)
