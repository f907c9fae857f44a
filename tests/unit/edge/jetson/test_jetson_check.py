"""`smartexit jetson check`: facts from a device root built of the project's identity fixtures
(tests/fixtures/jetson/identity), verdicts for supported, too old, missing and newer-than-tested stacks, and
what it prints and exits with on and off the device."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge.jetson import check as check_mod
from edge.jetson import facts as facts_mod
from edge.jetson.check import CheckConfig, evaluate, render, verdict
from edge.jetson.facts import collect
from edge.pipeline.cli import main as cli
from tests.unit.edge.jetson.conftest import device_root
from tests.unit.edge.jetson.jetson_identity import REPO, block

DPKG = "dpkg_package_versions.txt"
CLOCKS = "clocks_nvpmodel_release_samples.txt"


def _done(argv, stdout, rc=0):
    return subprocess.CompletedProcess(argv, rc, stdout, "")


# SYNTHETIC: the torch probe's line (edge/jetson/commands.TORCH_PROBE) with the version of NVIDIA's torch wheel
# for JetPack 6.1 (torch-2.5.0a0+872d972e41.nv24.08, "Installing PyTorch for Jetson Platform")
TORCH_JP61 = "torch 2.5.0a0+872d972e41.nv24.08 cuda True\n"


def fake_tools(dpkg: str, nvpmodel: str | None, clocks: str | None, torch: str | None = TORCH_JP61):
    """A runner answering dpkg-query, nvpmodel -q and jetson_clocks --show with the given texts, and
    the torch probe; None: the tool fails as on a board where it is missing (run_command raises)."""
    def run(argv):
        text = {"dpkg-query": dpkg, "nvpmodel": nvpmodel, "sudo": clocks}.get(argv[0], torch)
        if text is None:
            from edge.core.errors import SmartExitError
            raise SmartExitError(f"{argv[0]} is not installed or not on PATH")
        return _done(argv, text, 1 if argv[0] == "dpkg-query" else 0)  # dpkg-query: 1 = some pattern unmatched
    return run


def jp62_dpkg() -> str:
    """The L4T core line of an AGX Orin 64GB on 36.4.4 and the CUDA / cuDNN / TensorRT lines of a JetPack 6.2.1
    install (36.4.7): the project's fixture lines of two boards with the same stack (JetPack 6.2.x)."""
    return block(DPKG, "L4T 36.4.4") + block(DPKG, "L4T 36.4.7 | JetPack 6.2.1 | Orin Nano")


def jp5_dpkg() -> str:
    """JetPack 5.1.4's stack as jetson_release prints it (CUDA 11.4.315, cuDNN 8.6.0.166, TensorRT 8.5.2.2),
    rewritten as dpkg-query lines (SYNTHETIC layout, NVIDIA's versions; the package names are JetPack 5's)."""
    rel = block(CLOCKS, "`jetson_release` (jetson-stats 4.2.12)")
    v = dict(line.strip(" -").split(": ", 1) for line in rel.splitlines() if line.startswith(" - ") and ": " in line)
    return (f"ii  nvidia-l4t-core 35.6.0-20240828\nii  cuda-cudart-11-4 {v['CUDA']}-1\n"
            f"ii  libcudnn8 {v['cuDNN']}-1+cuda11.4\nii  libnvinfer8 {v['TensorRT']}-1+cuda11.4\n")


def rows_by(rows):
    return {r.component: r for r in rows}


def test_supported_jetpack_6_2(tmp_path):
    root = device_root(tmp_path / "root")
    f = collect(root, fake_tools(jp62_dpkg(), block(CLOCKS, "`nvpmodel -q` | Orin Nano"),
                                 block(CLOCKS, "`sudo jetson_clocks --show` | AGX Orin")),
                root / "opt/tritonserver", python=(3, 10, 12))
    assert f.jetson and f.model == "NVIDIA Jetson AGX Orin Developer Kit"
    assert (f.l4t, f.jetpack, f.stack.cuda, f.stack.tensorrt, f.stack.cudnn) == ("36.4.4", "6.2.1", "12.6.68",
                                                                                 "10.3.0.30", "9.3.0.75")
    rows = evaluate(f)
    r = rows_by(rows)
    assert {k: r[k].status for k in ("l4t", "cuda", "tensorrt", "cudnn", "trtexec", "triton", "python")} == dict.fromkeys(
        ("l4t", "cuda", "tensorrt", "cudnn", "trtexec", "triton", "python"), "ok")
    assert r["jtop"].status == "info" and "jetson-stats" in r["jtop"].install  # optional: said, not judged
    assert r["torch_cuda"].status == "ok" and r["torch_cuda"].found == "torch 2.5.0a0+872d972e41.nv24.08 with CUDA"
    assert r["clocks"].status == "info" and "sudo jetson_clocks" in r["clocks"].install  # not locked
    assert verdict(rows) == "supported"
    text = render(f, rows)
    assert "verdict: supported" in text and "36.4.4 (JetPack 6.2.1)" in text


@pytest.mark.parametrize("probe", ["torch 2.3.1 cuda False\n", None, "Traceback ...\nModuleNotFoundError: torch\n"])
def test_torch_without_cuda_is_said_not_judged(tmp_path, probe):
    """PyPI's aarch64 torch (no CUDA), no torch, or a failing import: the torch_static path is not there;
    the row says what to install, and the verdict stays the TensorRT path's."""
    root = device_root(tmp_path / "root")
    f = collect(root, fake_tools(jp62_dpkg(), block(CLOCKS, "`nvpmodel -q` | Orin Nano"),
                                 block(CLOCKS, "`sudo jetson_clocks --show` | AGX Orin"), torch=probe),
                root / "opt/tritonserver", python=(3, 10, 12))
    rows = evaluate(f)
    r = rows_by(rows)
    assert r["torch_cuda"].status == "info" and "JetPack's PyTorch wheel" in r["torch_cuda"].install
    assert verdict(rows) == "supported"
    if probe and probe.startswith("torch"):
        assert f.torch == "2.3.1" and f.torch_cuda is False
    else:
        assert f.torch is None and "torch" in f.errors


def test_too_old_jetpack_5(tmp_path):
    root = device_root(tmp_path / "root", release="R35.6.1")
    f = collect(root, fake_tools(jp5_dpkg(), block(CLOCKS, "`jetson_release` (jetson-stats 4.2.12)"), None),
                root / "opt/tritonserver", python=(3, 8, 10))
    r = rows_by(evaluate(f))
    assert f.l4t == "35.6.1" and f.jetpack == "5.1.5"
    assert {k: r[k].status for k in ("l4t", "cuda", "tensorrt", "cudnn", "python")} == dict.fromkeys(
        ("l4t", "cuda", "tensorrt", "cudnn", "python"), "too_old")
    assert "nvidia-jetpack" in r["cuda"].install and "SDK Manager" in r["l4t"].install
    assert "clocks" in f.errors and r["clocks"].status == "info"  # sudo -n failed: said, not fatal
    assert verdict(evaluate(f)) == "unsupported"


def test_missing_tensorrt_and_triton(tmp_path):
    root = device_root(tmp_path / "root", triton=None, trtexec=False)
    only_core = block(DPKG, "L4T 36.4.4")  # a fresh flash before `apt install nvidia-jetpack`
    f = collect(root, fake_tools(only_core, block(CLOCKS, "`nvpmodel -q` | Orin Nano"), None),
                root / "opt/tritonserver", python=(3, 10, 12))
    r = rows_by(evaluate(f))
    assert {k: r[k].status for k in ("cuda", "tensorrt", "cudnn", "trtexec", "triton")} == dict.fromkeys(
        ("cuda", "tensorrt", "cudnn", "trtexec", "triton"), "missing")
    assert "Triton 2.49.0" in r["triton"].install and "libnvinfer-bin" in r["trtexec"].install
    text = render(f, evaluate(f))
    assert "verdict: unsupported" in text and "to do:" in text


def test_newer_than_tested_is_untested_not_refused(tmp_path):
    root = device_root(tmp_path / "root", release="R38.4.0", triton="2.52.0")
    f = collect(root, fake_tools(block(DPKG, "L4T 38.4.0"), block(CLOCKS, "`nvpmodel -q` | Orin Nano"), None),
                root / "opt/tritonserver", python=(3, 10, 12))
    r = rows_by(evaluate(f))
    assert f.jetpack == "7.1" and r["l4t"].status == "untested" and r["triton"].status == "untested"
    assert "glibc" in r["triton"].install


def test_versions_compare_numerically():
    req = check_mod.Requirement("tensorrt", "10.3", "11", "x")
    assert [check_mod.judge(v, req) for v in ("10.3.0.30", "10.16.0", "8.5.2.2", "11.0", None, "abc")] == [
        "ok", "ok", "too_old", "untested", "missing", "untested"]


def test_main_on_a_device_root_prints_and_saves(tmp_path, monkeypatch, capsys):
    root = device_root(tmp_path / "root")
    tools = fake_tools(jp62_dpkg(), block(CLOCKS, "`nvpmodel -q` | Orin Nano"),
                       block(CLOCKS, "`sudo jetson_clocks --show` | AGX Orin"))
    monkeypatch.setattr(check_mod.device, "run_command", lambda argv, timeout=600: tools(argv))
    monkeypatch.setattr(facts_mod.sys, "version_info", (3, 10, 12, "final", 0))
    run = tmp_path / "run"
    rc = check_mod.main(CheckConfig(root=str(root), run_dir=str(run), triton_home=str(root / "opt/tritonserver"),
                                    save=True))
    out = capsys.readouterr().out
    assert rc == 0 and "verdict: supported" in out
    saved = json.loads((run / "jetson/device/check.json").read_text())
    assert saved["verdict"] == "supported" and saved["facts"]["stack"]["tensorrt"] == "10.3.0.30"


def test_off_device_exit_code_2_and_dry_run(tmp_path, capsys):
    assert cli(["jetson", "check", f"root={tmp_path}"]) == 2
    assert "not a Jetson" in capsys.readouterr().err
    assert cli(["jetson", "check", f"root={tmp_path}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "a real run here stops with exit code 2" in out
    assert "nvpmodel -q" in out.splitlines() and "sudo -n jetson_clocks --show" in out.splitlines()
    assert ("dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}\\n' nvidia-l4t-core nvidia-jetpack "
            "'cuda-cudart-*' 'libcudnn*' 'libnvinfer*' tensorrt") in out.splitlines()


def test_console_script_exit_code():
    res = subprocess.run([sys.executable, "-m", "edge.pipeline.cli", "jetson", "check", "root=/nonexistent-root"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and "not a Jetson" in res.stderr
