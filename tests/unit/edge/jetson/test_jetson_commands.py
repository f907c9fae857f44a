"""Every device command line, compared as a list (STYLE.md 8)."""
from __future__ import annotations

import pytest

from edge.core.errors import ConfigError
from edge.jetson import commands as c
from exporters.tensorrt import EngineBuildConfig


def test_identity_commands():
    assert c.dpkg_versions_argv(["nvidia-l4t-core", "libnvinfer*"]) == [
        "dpkg-query", "-W", "-f", "${db:Status-Abbrev} ${Package} ${Version}\\n", "nvidia-l4t-core", "libnvinfer*"]
    assert c.dpkg_versions_argv(["tensorrt"], "/mnt/img/var/lib/dpkg")[1] == "--admindir=/mnt/img/var/lib/dpkg"
    assert c.nvpmodel_query_argv() == ["nvpmodel", "-q"]
    assert c.jetson_clocks_show_argv() == ["sudo", "-n", "jetson_clocks", "--show"]


def test_ssh_and_rsync():
    assert c.remote_shell("smartexit", [".venv/bin/smartexit", "bench", "decode", "run_dir=artifacts/my run"]) == (
        "cd smartexit && .venv/bin/smartexit bench decode 'run_dir=artifacts/my run'")
    assert c.ssh_argv("me@orin", "cd smartexit && ls", ["-p", "2222"]) == ["ssh", "-p", "2222", "me@orin",
                                                                           "cd smartexit && ls"]
    assert c.rsync_push_argv("artifacts/demo", ["onnx", "manifest.json"], "me@orin", "smartexit/artifacts/demo") == [
        "rsync", "-a", "--hard-links", "--relative", "--delete", "--exclude=.*", "artifacts/demo/./onnx",
        "artifacts/demo/./manifest.json", "me@orin:smartexit/artifacts/demo/"]
    assert c.rsync_files_argv("list.txt", "/src", "me@orin", "/home/me/smartexit", ["-p", "2222"]) == [
        "rsync", "-a", "--files-from=list.txt", "-e", "ssh -p 2222", "/src/", "me@orin:/home/me/smartexit/"]
    assert c.rsync_pull_argv("me@orin", "smartexit/artifacts/demo/bench/", "artifacts/demo/jetson/bench") == [
        "rsync", "-a", "me@orin:smartexit/artifacts/demo/bench/", "artifacts/demo/jetson/bench"]
    assert c.git_ls_files_argv("/repo") == ["git", "-C", "/repo", "ls-files"]


@pytest.mark.parametrize("bad", ["~/smartexit", ""])
def test_remote_dir_must_not_rely_on_tilde(bad):
    with pytest.raises(ConfigError, match="remote_dir"):
        c.remote_shell(bad, ["ls"])


def test_trtexec_build_and_infer():
    shapes = {"exit_hidden": ((1, 1, 64), (2, 1, 64), (4, 1, 64))}
    cfg = EngineBuildConfig(precision="int8", max_batch=4, opt_batch=2, timing_cache="/r/jetson/engines/timing.cache")
    assert c.trtexec_build_argv(c.TRTEXEC, "/r/onnx/head.onnx", "/r/jetson/engines/head.plan", shapes, cfg) == [
        "/usr/src/tensorrt/bin/trtexec", "--onnx=/r/onnx/head.onnx", "--saveEngine=/r/jetson/engines/head.plan",
        "--minShapes=exit_hidden:1x1x64", "--optShapes=exit_hidden:2x1x64", "--maxShapes=exit_hidden:4x1x64",
        "--memPoolSize=workspace:1024M", "--fp16", "--int8", "--timingCacheFile=/r/jetson/engines/timing.cache",
        "--profilingVerbosity=detailed", "--dumpLayerInfo"]
    assert c.trtexec_infer_argv(c.TRTEXEC, "/e/head.plan", {"exit_hidden": [2, 1, 64]},
                                {"exit_hidden": "/p/head/exit_hidden.bin"}, "/d/head.json") == [
        "/usr/src/tensorrt/bin/trtexec", "--loadEngine=/e/head.plan", "--shapes=exit_hidden:2x1x64",
        "--loadInputs=exit_hidden:/p/head/exit_hidden.bin", "--exportOutput=/d/head.json", "--iterations=1",
        "--warmUp=0", "--duration=0"]


def test_never_fp8_on_orin():
    with pytest.raises(ConfigError, match="sm_87"):
        c.refuse_forbidden_flags(["trtexec", "--onnx=x.onnx", "--fp8"])
    assert c.refuse_forbidden_flags(["trtexec", "--fp16"]) == ["trtexec", "--fp16"]


def test_systemd_commands():
    assert c.install_unit_argv("artifacts/demo/jetson/units/smartexit-serve.service") == [
        "sudo", "install", "-m", "0644", "artifacts/demo/jetson/units/smartexit-serve.service",
        "/etc/systemd/system/smartexit-serve.service"]
    assert c.systemctl_argv("enable", "--now", "a.service") == ["sudo", "systemctl", "enable", "--now", "a.service"]
    assert c.systemctl_status_argv(["a.service", "b.service"]) == ["systemctl", "status", "--no-pager", "--lines=10",
                                                                    "a.service", "b.service"]
    assert c.systemctl_is_active_argv("a.service") == ["systemctl", "is-active", "a.service"]
    assert c.remove_units_argv(["a.service"]) == ["sudo", "rm", "-f", "/etc/systemd/system/a.service"]
