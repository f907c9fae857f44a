"""tegrastats on real device captures: the parser on every real line of the shared fixtures, the rail rule
per board, the running-mean meaning of the second figure, the integral of a real workload window computed by
hand, and the meter replaying a real log.

The captures were made on Jetsons by other people (provenance in their SOURCES.md). They are another
repository's data: read in place from ../shared/data/jetson_fixtures (or $SMARTEXIT_SHARED), never copied
into this repository, and each test here skips naming the file it did not find. The same parser checks on
the project's own fixtures run on every clone in ``test_tegrastats.py``.
"""
from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from edge.energy.meter import SensorUnavailable
from edge.energy.rails import AGX_ORIN_SUMMED, select_rails
from edge.energy.tegrastats import LineFormat, TegrastatsMeter, parse_line, parse_lines, window_joules
from tests.unit.edge.energy.shared_fixtures import TEGRASTATS, skip_without, tegrastats_logs
from tests.unit.edge.energy.test_tegrastats import AGX, MODULE, REFUSED, _alive, check_line
from tests.unit.edge.energy.test_tegrastats import fake_tegrastats  # noqa: F401  (fixture)

# Which rail rule each capture gets (SOURCES.md says which board each is).
LAYOUT = {
    "agx_orin_32gb_r36.4_nonroot_rudi2.log": AGX,
    "agx_orin_64gb_r35_and_r36.0_unsourced.log": AGX,
    "agx_orin_64gb_r36.4.4_tegra_exporter.log": AGX,
    "agx_orin_64gb_r36.4_nonroot_unsourced.log": AGX,
    "agx_orin_64gb_r36_mode30w_llm_pipeline_a.log": AGX,
    "agx_orin_64gb_r36_mode30w_llm_pipeline_b.log": AGX,
    "agx_orin_64gb_r36_mode30w_radioml_fp16_bs1024.log": AGX,
    "agx_orin_64gb_r36_mode30w_radioml_fp32_bs512.log": AGX,
    "agx_orin_jp5_r35.log": AGX,
    "agx_orin_jp7_r39_three_value.log": AGX,
    "orin_nano_8gb_r36_beszel.log": MODULE,
    "orin_nano_class_unsourced.log": MODULE,
    "orin_nx_16gb_r36_nonroot_resplit_unsourced.log": MODULE,
    "orin_nx_16gb_r36_single_lines_unsourced.log": MODULE,
    # negative fixtures: Xavier NX has the same names and its VDD_IN is its module input too, so the
    # total is right; Thor's and JetPack 4 Nano's rails are refused with a clear error
    "xavier_nx_jp5_negative_same_rail_names.log": MODULE,
    "thor_r38.4_tegra_exporter.log": REFUSED,
    "thor_r39.2_three_value_unsourced.log": REFUSED,
    "nano_jp4_legacy_pom_no_units.log": REFUSED,
}
THREE_VALUE_FILES = {"agx_orin_jp7_r39_three_value.log", "thor_r39.2_three_value_unsourced.log"}
LEGACY_FILES = {"nano_jp4_legacy_pom_no_units.log"}
# Continuous captures that begin where tegrastats started (first line: second figure == first).
CONTINUOUS = ["agx_orin_64gb_r36_mode30w_llm_pipeline_a.log", "agx_orin_64gb_r36_mode30w_llm_pipeline_b.log",
              "agx_orin_64gb_r36_mode30w_radioml_fp16_bs1024.log", "agx_orin_64gb_r36_mode30w_radioml_fp32_bs512.log",
              "xavier_nx_jp5_negative_same_rail_names.log", "nano_jp4_legacy_pom_no_units.log",
              "agx_orin_64gb_r36.4.4_tegra_exporter.log", "thor_r38.4_tegra_exporter.log"]


def lines_of(name: str) -> list[str]:
    skip_without(TEGRASTATS / name)
    return [line for line in (TEGRASTATS / name).read_text().splitlines() if line.strip()]


def record(name: str, n: int):
    """Line ``n`` (1-based) of capture ``name``, parsed (skips where the file is absent)."""
    return parse_line(lines_of(name)[n - 1])


def test_every_capture_is_classified():
    skip_without(TEGRASTATS)
    assert set(tegrastats_logs()) == set(LAYOUT), "a new fixture file: classify it in LAYOUT"


@pytest.mark.parametrize("name", tegrastats_logs() or ["<folder absent>"])
def test_every_real_line_parses(name):
    skip_without(TEGRASTATS)
    lines = lines_of(name)
    expected_format = (LineFormat.THREE_VALUE if name in THREE_VALUE_FILES else
                       LineFormat.LEGACY_NO_UNITS if name in LEGACY_FILES else LineFormat.TWO_VALUE)
    for n, line in enumerate(lines, 1):
        check_line(line, f"{name}:{n}", LAYOUT[name], expected_format)


def test_lines_without_timestamp():
    # SOURCES.md: the JetPack 4 Nano log has none, and line 3 of the R36.4 non-root file has none
    assert all(r.timestamp is None for r in parse_lines(lines_of("nano_jp4_legacy_pom_no_units.log")))
    r = record("agx_orin_64gb_r36.4_nonroot_unsourced.log", 3)
    assert r.timestamp is None
    # VDD_GPU_SOC 3193 + VDD_CPU_CV 399 + VIN_SYS_5V0 4306 = 7898 mW
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(7.898)


def test_jetpack5_agx_orin_line_by_hand():
    r = record("agx_orin_jp5_r35.log", 1)
    assert r.timestamp == datetime(2023, 4, 24, 0, 1, 24)
    assert (r.ram_used_mb, r.ram_total_mb) == (1282, 62795)
    # 6 power entries, two NC: VDD_GPU_SOC 2399 + VDD_CPU_CV 400 + VIN_SYS_5V0 4032 = 6831 mW;
    # VDDQ_VDD2_1V8AO 301 mW reported, not added
    assert set(r.rails) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert r.rails["VDDQ_VDD2_1V8AO"].now_w == pytest.approx(0.301)
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(6.831)
    assert r.offline_sensors == ("CV0", "CV1", "GPU", "CV2")  # printed as -256C
    assert r.temperatures_c["CPU"] == 42.593 and r.temperatures_c["Tboard"] == 32.0 and r.temperatures_c["tj"] == 42.593
    assert r.gpu_util_pct == 0.0


def test_jetpack6_negative_and_zero_rails_by_hand():
    r = record("agx_orin_64gb_r35_and_r36.0_unsourced.log", 2)  # JetPack 6.0: lower-case, tboard/tdiode
    assert r.rails["VDD_CPU_CV"].now_w == pytest.approx(-0.398)
    assert r.temperatures_c["tboard"] == 27.0 and r.temperatures_c["tdiode"] == 27.5
    # 1592 - 398 + 2624 = 3818 mW: the negative reading is kept as read
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(3.818)
    zero = record("agx_orin_32gb_r36.4_nonroot_rudi2.log", 1)
    assert zero.rails["VDD_CPU_CV"].now_w == 0.0
    assert select_rails(zero.rails).total_watts(zero.watts()) == pytest.approx(1.995 + 2.524)


def test_second_figure_is_kept_apart_from_the_first():
    r = record("agx_orin_64gb_r36.4.4_tegra_exporter.log", 2)
    assert (r.rails["VIN_SYS_5V0"].now_w, r.rails["VIN_SYS_5V0"].mean_w) == (4.607, 4.657)
    nx = record("orin_nx_16gb_r36_nonroot_resplit_unsourced.log", 1)
    assert (nx.rails["VDD_IN"].now_w, nx.rails["VDD_IN"].mean_w) == (12.673, 8.213)
    assert select_rails(nx.rails).total_watts(nx.watts()) == 12.673  # the instantaneous figure


@pytest.mark.parametrize("name", CONTINUOUS)
def test_second_figure_is_the_running_mean_since_start(name):
    """On captures that start with tegrastats, each line's second figure is the mean of all first
    figures so far (not a window average); 1 mW tolerance: every printed figure is rounded to 1 mW."""
    recs = parse_lines(lines_of(name))
    for rail in recs[0].rails:
        nows = [r.rails[rail].now_w for r in recs]
        for k, r in enumerate(recs, 1):
            assert abs(sum(nows[:k]) / k - r.rails[rail].mean_w) <= 1e-3, f"{name} line {k} {rail}"


def test_jetpack7_three_values_by_hand():
    r = record("agx_orin_jp7_r39_three_value.log", 1)
    assert r.format is LineFormat.THREE_VALUE
    assert r.rails["VDD_GPU_SOC"].max_w == pytest.approx(5.139)
    assert r.temperatures_c["cpu"] == 52.968 and r.gpu_util_pct == 12.0
    # 5139 + 3268 + 5500 = 13907 mW
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(13.907)


def test_module_input_is_used_alone():
    r = record("orin_nano_8gb_r36_beszel.log", 1)
    # VDD_IN 12479 mW alone, not 12479 + 4667 + 2817
    assert select_rails(r.rails).total_watts(r.watts()) == pytest.approx(12.479)
    assert r.gpu_util_pct == 63.0
    xavier = record("xavier_nx_jp5_negative_same_rail_names.log", 13)
    sel = select_rails(xavier.rails)
    assert sel.rails == ("VDD_IN",) and sel.total_watts(xavier.watts()) == pytest.approx(13.353)


def test_negative_fixtures_refused_or_flagged():
    thor = record("thor_r38.4_tegra_exporter.log", 1)
    assert thor.gpu_util_pct is None  # "GR3D_FREQ @[0,0,0]": no percentage
    assert thor.rails["VDD_CPU_SOC_MSS"].now_w == pytest.approx(4.165)
    with pytest.raises(ValueError, match=r"unknown Jetson rail layout \['VDD_CPU_SOC_MSS', 'VDD_GPU', 'VIN_SYS_5V0'\]"):
        select_rails(thor.rails)
    nano = record("nano_jp4_legacy_pom_no_units.log", 1)
    assert nano.format is LineFormat.LEGACY_NO_UNITS and nano.rails["POM_5V_IN"].now_w == pytest.approx(0.920)
    with pytest.raises(ValueError, match="POM_5V_IN"):
        select_rails(nano.rails)


def test_timestamps_that_skip_seconds():
    recs = parse_lines(lines_of("agx_orin_64gb_r36_mode30w_llm_pipeline_a.log"))
    gaps = [(b.timestamp - a.timestamp).total_seconds() for a, b in zip(recs, recs[1:])]
    assert set(gaps) == {1.0, 2.0} and gaps.count(2.0) == 3  # SOURCES.md: three two-second gaps


@pytest.mark.parametrize("name, hand_joules", [
    # fp32: totals (mW) at :01 8611, :02 10223, :03 10324, :04 10324, :05 10223, :06 10223, :07 7818, :08 7318.
    # start 15:08:01.610 -> 8611 + 0.61 * (10223 - 8611) = 9594.32; end 15:08:07.115 -> 7818 - 0.115 * 500 = 7760.5
    # 0.39 * (9594.32 + 10223) / 2 + 10273.5 + 10324 + 10273.5 + 10223 + 9020.5 + 0.115 * (7818 + 7760.5) / 2
    # = 3864.3774 + 50114.5 + 895.76375 = 54874.64115 mJ
    ("agx_orin_64gb_r36_mode30w_radioml_fp32_bs512", 54.87464115),
    # fp16: totals at :51 6711, :52 8224, :53 8023, :54 7916, :55 8014, :56 6111, :57 5510.
    # start :51.167 -> 6711 + 0.167 * 1513 = 6963.671; end :56.041 -> 6111 - 0.041 * 601 = 6086.359
    # 0.833 * (6963.671 + 8224) / 2 + 8123.5 + 7969.5 + 7965 + 7062.5 + 0.041 * (6111 + 6086.359) / 2
    # = 6325.66497 + 31120.5 + 250.04586 = 37696.21083 mJ
    ("agx_orin_64gb_r36_mode30w_radioml_fp16_bs1024", 37.69621083),
])
def test_integral_over_a_real_workload_window(name, hand_joules):
    recs = parse_lines(lines_of(f"{name}.log"))
    window = json.loads((TEGRASTATS / f"{name}.window.json").read_text())
    start, end = (datetime.fromisoformat(window[k]) for k in ("start_time", "end_time"))
    joules = window_joules(recs, select_rails(recs[0].rails), start, end)
    assert joules == pytest.approx(hand_joules, rel=1e-9)
    with pytest.raises(ValueError, match="not inside the log"):
        window_joules(recs, select_rails(recs[0].rails), start.replace(hour=14), end)


def test_meter_replays_a_real_agx_orin_log(fake_tegrastats, tmp_path):
    src = TEGRASTATS / "agx_orin_64gb_r36_mode30w_radioml_fp32_bs512.log"
    skip_without(src)
    meter = TegrastatsMeter(0.02, binary=fake_tegrastats(src), probe=False)
    meter.start()
    time.sleep(0.1)
    m = meter.stop()
    meter.close()
    assert m.rails == list(AGX_ORIN_SUMMED) and "not the board's input power" in m.reason
    # the log's first three lines: 2798 + 1599 + 3421, 2399 + 1199 + 3220, 2399 + 1199 + 3215 mW
    assert [s.watts for s in m.samples[:3]] == pytest.approx([7.818, 6.818, 6.813])
    assert all(b.t >= a.t for a, b in zip(m.samples, m.samples[1:]))


def test_meter_refuses_a_real_thor_log(fake_tegrastats, tmp_path):
    src = TEGRASTATS / "thor_r38.4_tegra_exporter.log"
    skip_without(src)
    with pytest.raises(SensorUnavailable, match="unknown Jetson rail layout"):
        TegrastatsMeter(0.02, binary=fake_tegrastats(src))
    pids = [int(p) for p in fake_tegrastats.pids.read_text().split()]
    assert pids and not any(_alive(p) for p in pids)
