"""The make targets (deploy/jetson/jetson.mk through the top-level Makefile): `make -n` of the whole chain and
`make DRY_RUN=1 jetson-...` on a stand-in run folder, here, without touching the venv.

`-o .venv/.installed` tells make to treat the venv's stamp as up to date (never re-install), and BIN points
at the interpreter running these tests, whose `smartexit` the targets call.
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.edge.jetson.jetson_identity import REPO

BIN = Path(sys.executable).parent
TARGETS = ("jetson-check", "jetson-push", "jetson-engines", "jetson-serve", "jetson-status", "jetson-stop",
           "jetson-bench")


def make(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed here")
    if not (BIN / "smartexit").is_file():
        pytest.skip(f"no smartexit console script beside {sys.executable} (pip install -e .)")
    return subprocess.run(["make", "-C", str(REPO), "--no-print-directory", "-o", ".venv/.installed",
                           f"BIN={BIN}", *args], capture_output=True, text=True, timeout=300)


def test_make_n_prints_every_target(run_dir):
    for target in TARGETS:
        res = make("-n", target, f"ART={run_dir}", "DEVICE=me@orin")
        assert res.returncode == 0, res.stderr
        (line,) = [ln for ln in res.stdout.splitlines() if ln.strip()]
        argv = shlex.split(line)
        assert argv[:3] == [f"{BIN}/smartexit", "jetson", target.removeprefix("jetson-")], line


def test_make_n_of_the_whole_chain_from_nothing(tmp_path):
    """A run that does not exist yet: `make -n jetson-push` lists every pipeline stage it needs first."""
    art = tmp_path / "fresh"
    res = make("-n", "jetson-push", f"ART={art}", "DEVICE=me@orin")
    assert res.returncode == 0, res.stderr
    stages = [shlex.split(ln)[1] for ln in res.stdout.splitlines() if ln.startswith(f"{BIN}/smartexit")]
    assert stages == ["distill", "compress", "export", "calibrate", "repo", "jetson"]
    assert res.stdout.splitlines()[-1].rstrip().endswith(f"jetson push run_dir={art} device=me@orin remote_dir=smartexit")
    assert not art.exists()


@pytest.mark.parametrize("target", TARGETS)
def test_dry_run_of_every_target(target, run_dir):
    res = make(target, "DRY_RUN=1", f"ART={run_dir}", "DEVICE=me@orin")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"{BIN}/smartexit jetson {target.removeprefix('jetson-')} ") and "dry_run=true" in lines[0]
    on_device = target not in ("jetson-push", "jetson-bench")
    assert ("a real run here stops with exit code 2" in res.stdout) == on_device
    assert any(ln and not ln.startswith("#") for ln in lines[1:]), "a dry run prints the commands it would run"
    assert not (run_dir / "jetson").exists()  # touched nothing


def test_on_device_targets_refuse_here(run_dir):
    res = make("jetson-engines", f"ART={run_dir}")
    assert res.returncode == 2 and "not a Jetson" in res.stderr


def test_dry_run_with_a_device_root(run_dir, tmp_path):
    """With a stand-in device root (real /etc/nv_tegra_release) the same dry run is the on-device one."""
    from tests.unit.edge.jetson.conftest import device_root

    root = device_root(tmp_path / "root")
    res = make("jetson-check", "DRY_RUN=1", f"ART={run_dir}", f"JETSON_ARGS=root={root}")
    assert res.returncode == 0 and "not a Jetson" not in res.stdout
    assert "nvpmodel -q" in res.stdout.splitlines()
