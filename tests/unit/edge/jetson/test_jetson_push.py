"""`smartexit jetson push`: what is copied (never more), its dry run, and a real push through real rsync and
sha256sum to a stand-in device (an `ssh` on PATH that runs the remote command in a local folder)."""
from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError
from edge.jetson import push as push_mod
from edge.jetson.push import PushConfig, plan_items, policy_files, verify_script
from edge.jetson.steps import StepFailed
from edge.pipeline.cli import main as cli
from tests.unit.edge.jetson.jetson_identity import REPO

# stands in for ssh: options and host are dropped, the command runs here in $FAKE_REMOTE_HOME (as ssh runs
# it in the remote home); rsync calls it the same way to start its remote side
FAKE_SSH = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in -p|-o|-i|-l) shift 2 ;; -*) shift ;; *) break ;; esac
done
shift
cd "$FAKE_REMOTE_HOME" || exit 255
exec sh -c "$*"
"""


def printed_commands(out: str) -> list[list[str]]:
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]


def test_plan_copies_deployables_only(run_dir):
    m = Manifest(run_dir)
    assert [i.rel for i in plan_items(m, bench=False)] == ["onnx", "calibration/thresholds.json", "triton"]
    assert [i.rel for i in plan_items(m, bench=True)] == ["onnx", "calibration/thresholds.json", "triton",
                                                          "onnx_full", "multi_exit", "compressed"]
    (run_dir / "onnx" / "embed.onnx").write_bytes(b"changed")
    with pytest.raises(ArtifactError, match="changed since stage 'export'"):
        plan_items(Manifest(run_dir), bench=False)


def test_plan_needs_the_repository(tmp_path, tiny_export):
    from tests.unit.edge.jetson.conftest import make_run

    run = make_run(tmp_path, tiny_export)
    m = Manifest(run)
    del m.data["stages"]["repo"]
    with pytest.raises(ArtifactError, match="stage 'repo' has not run; `make repo` first"):
        plan_items(m, bench=False)


def test_policy_travels_with_the_code_and_is_hashed(run_dir):
    m = Manifest(run_dir)
    m.record("train_scheduler", inputs={}, config={}, outputs={"policy": REPO / "scheduler/assets/ppo"}, metrics={},
             seconds=0)
    files = policy_files(Manifest(run_dir))
    assert {rel for _, rel in files} >= {"../../scheduler/assets/ppo/policy.zip", "../../scheduler/assets/ppo/policy.json"}


def test_dry_run_prints_the_commands(run_dir, capsys):
    rc = cli(["jetson", "push", f"run_dir={run_dir}", "device=me@orin", "ssh_options=[-p,2222]", "dry_run=true"])
    out = capsys.readouterr().out
    assert rc == 0
    cmds = printed_commands(out)
    assert cmds[0] == ["git", "-C", str(push_mod.REPO_ROOT), "ls-files"]
    assert cmds[1] == ["ssh", "-p", "2222", "me@orin", "mkdir -p smartexit/artifacts/run"]
    assert cmds[2] == ["rsync", "-a", f"--files-from={run_dir}/jetson/push/code_files.txt", "-e", "ssh -p 2222",
                       f"{push_mod.REPO_ROOT}/", "me@orin:smartexit/"]
    assert cmds[3] == ["rsync", "-a", "--hard-links", "--relative", "--delete", "--exclude=.*", "-e", "ssh -p 2222",
                       *(f"{run_dir}/./{p}" for p in ("onnx", "calibration/thresholds.json", "triton", "onnx_full",
                                                      "multi_exit", "compressed", "manifest.json", "jetson/parity",
                                                      "jetson/push")),
                       "me@orin:smartexit/artifacts/run/"]
    assert cmds[4] == ["ssh", "-p", "2222", "me@orin", "bash smartexit/artifacts/run/jetson/push/verify.sh"]
    assert "would record ONNX Runtime's outputs" in out and not (run_dir / "jetson").exists()  # touched nothing


def test_device_is_required(run_dir, capsys):
    assert cli(["jetson", "push", f"run_dir={run_dir}"]) == 2
    assert "DEVICE=user@host" in capsys.readouterr().err


@pytest.fixture
def fake_device(tmp_path, monkeypatch) -> Path:
    if shutil.which("rsync") is None or shutil.which("sha256sum") is None:
        pytest.skip("rsync or sha256sum is not installed here (the real push test copies with them)")
    bin_dir, home = tmp_path / "bin", tmp_path / "remote_home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_REMOTE_HOME", str(home))
    return home


def test_real_push_verifies_on_arrival(run_dir, fake_device, capsys):
    (run_dir / "onnx" / ".ort_cache").mkdir()
    (run_dir / "onnx" / ".ort_cache" / "x.onnx").write_text("derived cache")  # hidden: stays here
    rc = push_mod.main(PushConfig(run_dir=str(run_dir), device="me@orin", code=False))
    out = capsys.readouterr().out
    remote = fake_device / "smartexit" / "artifacts" / "run"
    assert rc == 0 and "push verified:" in out  # the device's sha256sum check, as it printed it
    assert (remote / "onnx" / "graphs.json").is_file() and (remote / "jetson" / "parity" / "parity_inputs.json").is_file()
    assert not (remote / "onnx" / ".ort_cache").exists()
    sums = (run_dir / "jetson" / "push" / "SHA256SUMS").read_text().splitlines()
    assert any(line.endswith("  onnx/segment_0.onnx") for line in sums)
    assert any(line.endswith("  jetson/parity/segment_0/hidden.bin") for line in sums)
    # the device-side manifest check agrees: the copy is exact
    assert Manifest(remote).verified_output("export", "graphs") == remote / "onnx"
    verify = remote / "jetson" / "push" / "verify.sh"
    assert subprocess.run(["bash", str(verify)], capture_output=True, text=True).returncode == 0
    (remote / "onnx" / "head.onnx").write_bytes(b"corrupted on the way")
    res = subprocess.run(["bash", str(verify)], capture_output=True, text=True)
    assert res.returncode == 1 and "onnx/head.onnx: FAILED" in res.stdout + res.stderr
    # a second push repairs it, and removes a stale file from a copied folder
    (remote / "onnx" / "stale.onnx").write_text("left over")
    assert push_mod.main(PushConfig(run_dir=str(run_dir), device="me@orin", code=False)) == 0
    assert not (remote / "onnx" / "stale.onnx").exists()


def test_push_stops_when_the_device_check_fails(run_dir, fake_device, monkeypatch):
    real = push_mod.sha256sums
    monkeypatch.setattr(push_mod, "sha256sums", lambda files: real(files).replace("  onnx/head.onnx", "  onnx/embed.onnx"))
    with pytest.raises(StepFailed, match="check every file's sha256 on the device.*exited 1"):
        push_mod.main(PushConfig(run_dir=str(run_dir), device="me@orin", code=False))


def test_code_push_sends_tracked_files(run_dir, fake_device):
    assert push_mod.main(PushConfig(run_dir=str(run_dir), device="me@orin", bench=False, record=False)) == 0
    remote = fake_device / "smartexit"
    assert (remote / "deploy" / "jetson" / "jetson.mk").is_file() and (remote / "pyproject.toml").is_file()
    assert not (remote / ".venv").exists() and not (remote / "artifacts" / "demo").exists()


def test_verify_script_is_clean_shell(tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed here")
    script = tmp_path / "verify.sh"
    script.write_text(verify_script("demo", 3))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    res = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
