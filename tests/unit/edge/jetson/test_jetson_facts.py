"""The device-fact parsers on the project's identity fixtures (tests/fixtures/jetson/identity, written by
hand in the layouts Jetsons print; every clone) and on the real strings Jetsons printed
(../shared/data/jetson_fixtures/identity, read in place; skipped, naming the file, where absent)."""
from __future__ import annotations

import re

import pytest

from edge.core.device import parse_l4t_release
from edge.core.errors import SmartExitError
from edge.jetson.facts import (JETPACK_OF_L4T, Stack, parse_dpkg, parse_jetson_clocks, parse_meminfo,
                               parse_nvpmodel_query, stack_versions, upstream_version)
from tests.unit.edge.jetson.jetson_identity import block, blocks

# /proc/meminfo: SYNTHETIC, hand-written in the format of proc(5) ("MemTotal:  <n> kB" per line); the
# numbers are invented (no real AGX Orin meminfo is in the shared fixtures)
MEMINFO_SYNTHETIC = """MemTotal:       64335836 kB
MemFree:        58000000 kB
MemAvailable:   60123456 kB
SwapTotal:      32167904 kB
SwapFree:       32167904 kB
"""
DPKG = "dpkg_package_versions.txt"
CLOCKS = "clocks_nvpmodel_release_samples.txt"
# the project's fixtures, and the shared real captures (each test on them skips where they are absent)
SOURCES = [pytest.param(False, id="project"), pytest.param(True, id="real")]


@pytest.mark.parametrize("real", SOURCES)
def test_every_nv_tegra_release_parses(real):
    samples = blocks("nv_tegra_release_samples.txt", real)
    assert len(samples) >= 10
    for head, text in samples:
        want = head.split(" | ")[0].lstrip("R")  # '36.4.4'
        rel = parse_l4t_release(text)  # some sources omit the leading '#' (tegra-exporter's Go comments)
        assert f"{rel.major}.{rel.revision}" == want, head
        assert want in JETPACK_OF_L4T, f"{want}: the JetPack table should name every sampled release"
        assert JETPACK_OF_L4T[want] == head.split(" | ")[1].split()[1], head  # 'JetPack 6.2.1' -> '6.2.1'


@pytest.mark.parametrize("real", SOURCES)
def test_dpkg_lines_of_a_jetpack_6_2_install(real):
    pkgs = parse_dpkg(block(DPKG, "L4T 36.4.7 | JetPack 6.2.1 | Orin Nano", real))
    assert pkgs["libnvinfer10"] == "10.3.0.30-1+cuda12.5" and pkgs["cuda-cudart-12-6"] == "12.6.68-1"
    stack = stack_versions(pkgs)
    # the TensorRT debs carry '+cuda12.5' though the CUDA runtime is 12.6.68 (NOTES.md); the toolkit
    # meta-package's own 12.6.11 is not the runtime's version
    assert pkgs["cuda-toolkit-12-6"] == "12.6.11-1"
    assert stack == Stack(l4t_core=None, jetpack=None, cuda="12.6.68", cudnn="9.3.0.75", tensorrt="10.3.0.30")


@pytest.mark.parametrize("real", SOURCES)
@pytest.mark.parametrize("starts,version", [("L4T 36.4.4", "36.4.4"), ("L4T 38.4.0", "38.4.0"),
                                            ("L4T 36.4.7 | JetPack 6.2.1 | AGX", "36.4.7"), ("L4T 36.4.3", "36.4.3"),
                                            ("L4T 36.3.0", "36.3.0"), ("L4T 35.4.1", "35.4.1")])
def test_l4t_core_package_lines(starts, version, real):
    """dpkg-query --show (space or tab separated), a padded version column and `dpkg -l` rows."""
    assert stack_versions(parse_dpkg(block(DPKG, starts, real))).l4t_core == version


def test_dpkg_skips_packages_that_are_not_installed():
    # SYNTHETIC rows in `dpkg -l`'s layout (dpkg-query(1)): 'rc' = removed, configuration files kept
    text = ("Desired=Unknown/Install/Remove/Purge/Hold\n||/ Name Version Architecture Description\n"
            "+++-====-=======-====-====\nrc  libnvinfer8  8.5.2-1+cuda11.4  arm64  old\n"
            "ii  libnvinfer10:arm64  10.3.0.30-1+cuda12.5  arm64  TensorRT\n")
    assert parse_dpkg(text) == {"libnvinfer10": "10.3.0.30-1+cuda12.5"}
    assert upstream_version("1:36.4.7-20250918154033") == "36.4.7"


@pytest.mark.parametrize("starts,name,mode_id", [
    ("`nvpmodel -q` with a warning line first", "MODE_30W", 2),
    ("`nvpmodel -q` | Orin Nano", "15W", 0),
    ("last line of `sudo jetson_clocks --show`", "MODE_50W", None),
    ("`jetson_release` (jetson-stats 4.3.1)", "MAXN", 0),
    ("`jetson_release` (jetson-stats 4.2.12)", "7W", 1),
])
def test_nvpmodel_query(starts, name, mode_id):
    mode = parse_nvpmodel_query(block(CLOCKS, starts))
    assert (mode.name, mode.id) == (name, mode_id)


@pytest.mark.parametrize("starts,name,mode_id", [
    ("`nvpmodel -q` format as emulated", "MAXTEST", 0),  # a warning line first
    ("`nvpmodel -q` | Orin Nano", "25W", 1),
    ("last line of `sudo jetson_clocks --show`", "MODE_30W", None),
    ("`jetson_release` (jetson-stats 4.3.1)", "15W", 0),
])
def test_nvpmodel_query_real(starts, name, mode_id):
    mode = parse_nvpmodel_query(block(CLOCKS, starts, real=True))
    assert (mode.name, mode.id) == (name, mode_id)


def test_nvpmodel_query_rejects_other_text():
    with pytest.raises(SmartExitError, match="nvpmodel"):
        parse_nvpmodel_query("command not found")


def test_jetson_clocks_show_agx_orin_maxn():
    c = parse_jetson_clocks(block(CLOCKS, "`sudo jetson_clocks --show` | AGX Orin"))
    assert c.machine == "NVIDIA Jetson AGX Orin Developer Kit" and c.online_cpus == "0-11" and len(c.cpus) == 12
    assert c.cpus["cpu4"].current_hz == 729600 and c.cpus["cpu4"].max_hz == 2201600  # kHz, as printed
    assert c.gpu.max_hz == 1300500000 and c.gpu.current_hz == 408000000
    assert c.emc.current_hz == c.emc.max_hz == 3199000000 and c.power_mode == "MAXN"  # the DLA line is not the GPU's
    assert not c.locked  # the GPU runs below its maximum: jetson_clocks was not run


def test_jetson_clocks_show_locked_orin_nano():
    text = block(CLOCKS, "`sudo jetson_clocks --show` | Orin Nano")
    c = parse_jetson_clocks(text)
    assert c.machine == "NVIDIA Jetson Orin Nano Developer Kit" and len(c.cpus) == 6
    assert c.gpu.max_hz == 624750000 and c.emc.current_hz == 2133000000 and c.power_mode == "15W"
    assert c.locked  # every CurrentFreq at its MaxFreq: what `sudo jetson_clocks` leaves
    # one CPU below its maximum is no longer locked
    assert not parse_jetson_clocks(text.replace("MaxFreq=1510400 CurrentFreq=1510400",
                                                "MaxFreq=1510400 CurrentFreq=729600", 1)).locked


def test_real_jetson_clocks_show_agx_orin_maxn():
    c = parse_jetson_clocks(block(CLOCKS, "`sudo jetson_clocks --show` | AGX Orin", real=True))
    assert c.machine == "Jetson AGX Orin" and c.online_cpus == "0-11" and len(c.cpus) == 12
    assert c.gpu.max_hz == 1300500000 and c.gpu.current_hz == 306000000
    assert c.emc.max_hz == 3199000000 and c.power_mode == "MAXN"
    assert not c.locked  # the GPU idles at its minimum: jetson_clocks was not run


def test_real_jetson_clocks_show_orin_nano_and_a_locked_variant():
    text = block(CLOCKS, "`sudo jetson_clocks --show` | same Orin Nano", real=True)
    c = parse_jetson_clocks(text)
    assert len(c.cpus) == 6 and c.gpu.max_hz == 918000000 and c.power_mode == "25W"
    # every CurrentFreq raised to its MaxFreq is what `sudo jetson_clocks` leaves (derived from the real text)
    locked = re.sub(r"MaxFreq=(\d+) CurrentFreq=\d+", r"MaxFreq=\1 CurrentFreq=\1", text)
    assert parse_jetson_clocks(locked).locked


def test_meminfo():
    m = parse_meminfo(MEMINFO_SYNTHETIC)
    assert (m.total_kib, m.available_kib, m.swap_total_kib) == (64335836, 60123456, 32167904)
    with pytest.raises(SmartExitError, match="MemAvailable"):
        parse_meminfo("MemTotal: 1 kB\n")
