"""systemd units (text, quoting, `systemd-analyze verify`) and `smartexit jetson serve | status | stop`."""
from __future__ import annotations

import getpass
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.core.errors import ArtifactError, ConfigError
from edge.jetson import serve as serve_mod
from edge.jetson.serve import JetsonServeConfig, check_api_key_config
from edge.jetson.units import (SERVE_UNIT, TRITON_UNIT, exec_line, serve_unit, systemd_word, triton_environment,
                               triton_unit)
from edge.pipeline.cli import main as cli
from scheduler.serving.tritonserver import TritonPorts
from tests.unit.edge.jetson.conftest import device_root


def test_systemd_quoting():
    assert systemd_word("/opt/tritonserver/bin/tritonserver") == "/opt/tritonserver/bin/tritonserver"
    assert systemd_word("run_dir=/home/me/my run") == '"run_dir=/home/me/my run"'
    assert systemd_word('50%"$HOME') == '"50%%\\"$$HOME"'  # specifier and variable kept literal
    with pytest.raises(ValueError, match="absolute"):
        exec_line(["smartexit", "serve"])


def _units(tmp_path: Path, api_key_config: Path | None) -> dict[str, str]:
    """Both units with their programs at real paths in tmp_path: `systemd-analyze verify` checks that
    ExecStart's program exists and is executable, so stand-in executables are made there."""
    home, venv = tmp_path / "tritonserver", tmp_path / "venv" / "bin"
    (home / "bin").mkdir(parents=True)
    venv.mkdir(parents=True)
    for exe in (home / "bin" / "tritonserver", venv / "smartexit"):
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    env = triton_environment(home, ["/srv/venv/lib/python3.10/site-packages"], "/srv/smartexit", "/usr/lib")
    return {TRITON_UNIT: triton_unit(user=getpass.getuser(), triton_home=home, repository=tmp_path / "run/triton",
                                     ports=TritonPorts(8010, 8001, 8002), env=env, workdir=tmp_path),
            SERVE_UNIT: serve_unit(user=getpass.getuser(), workdir=tmp_path, smartexit=venv / "smartexit",
                                   run_dir=tmp_path / "run", host="0.0.0.0" if api_key_config else "127.0.0.1",
                                   port=8000, triton_grpc="127.0.0.1:8001", api_key_config=api_key_config)}


def test_unit_text(tmp_path):
    units = _units(tmp_path, None)
    tri = units[TRITON_UNIT]
    start = next(line for line in tri.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(start.removeprefix("ExecStart="))
    assert argv[:3] == [str(tmp_path / "tritonserver/bin/tritonserver"), f"--model-repository={tmp_path}/run/triton",
                        f"--backend-directory={tmp_path}/tritonserver/backends"]  # explicit on Jetson
    assert {"--http-address=127.0.0.1", "--grpc-port=8001", "--http-port=8010", "--metrics-port=8002"} <= set(argv)
    assert ("Environment=SMARTEXIT_PYTHONPATH=/srv/venv/lib/python3.10/site-packages:/srv/smartexit" in tri
            and f"Environment=LD_LIBRARY_PATH={tmp_path}/tritonserver/lib:/usr/lib" in tri)
    srv = units[SERVE_UNIT]
    assert f"Requires={TRITON_UNIT}" in srv and f"After={TRITON_UNIT} network-online.target" in srv
    assert "serve.host=127.0.0.1 serve.port=8000 serve.triton_url=127.0.0.1:8001 serve.power_meter=auto" in srv
    with pytest.raises(ValueError, match="API key"):
        serve_unit(user="me", workdir=tmp_path, smartexit="/x/smartexit", run_dir="/r", host="0.0.0.0", port=8000,
                   triton_grpc="127.0.0.1:8001", api_key_config=None)
    keyed = _units(tmp_path / "k", tmp_path / "key.yaml")[SERVE_UNIT]
    assert f"serve --config {tmp_path}/key.yaml run_dir=" in keyed and "serve.host=0.0.0.0" in keyed


def test_units_pass_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` (syntax, known settings, ExecStart programs that exist; it loads the units
    without starting them). Where absent (not a systemd system), skipped."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    files = []
    for name, text in _units(tmp_path, tmp_path / "key.yaml").items():
        (tmp_path / name).write_text(text)
        files.append(str(tmp_path / name))
    res = subprocess.run(["systemd-analyze", "verify", *files], capture_output=True, text=True)
    assert res.returncode == 0 and "smartexit" not in res.stderr, res.stderr


def test_api_key_config_checks(tmp_path):
    key = tmp_path / "key.yaml"
    with pytest.raises(ConfigError, match="does not exist"):
        check_api_key_config(key)
    key.write_text("serve:\n  api_key: s3cret-Key\n")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        check_api_key_config(key)
    key.chmod(0o600)
    assert check_api_key_config(key) == key.resolve()
    key.write_text("serve:\n  host: 0.0.0.0\n")
    with pytest.raises(ConfigError, match="serve.api_key must be a non-empty string") as err:
        check_api_key_config(key)
    assert "s3cret" not in str(err.value)
    key.write_text("serve:\n  api_key: 0x1F\n")  # the text written, as `smartexit serve --config` reads it
    assert check_api_key_config(key) == key.resolve()


def _parity_passed(run: Path, passed: bool = True) -> None:
    from edge.core.artifacts import Manifest

    want = Manifest(run).stage("export")["outputs"]["graphs"]["sha256"]
    (run / "jetson/device").mkdir(parents=True, exist_ok=True)
    (run / "jetson/device/parity.json").write_text(json.dumps({"passed": passed, "graphs_sha256": want}))


def test_dry_run_off_device(run_dir, capsys):
    rc = cli(["jetson", "serve", f"run_dir={run_dir}", "dry_run=true"])
    out = capsys.readouterr().out
    assert rc == 0 and "a real run here stops with exit code 2" in out
    assert "no TensorRT engines yet" in out and "torch_static" in out  # no parity yet: the CUDA torch path
    cmds = [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]
    assert cmds[:5] == [
        ["sudo", "install", "-m", "0644", f"{run_dir}/jetson/units/{TRITON_UNIT}", f"/etc/systemd/system/{TRITON_UNIT}"],
        ["sudo", "install", "-m", "0644", f"{run_dir}/jetson/units/{SERVE_UNIT}", f"/etc/systemd/system/{SERVE_UNIT}"],
        ["sudo", "systemctl", "daemon-reload"],
        ["sudo", "systemctl", "enable", "--now", TRITON_UNIT],
        ["sudo", "systemctl", "enable", "--now", SERVE_UNIT]]
    assert not (run_dir / "jetson").exists()


def _backend(run: Path) -> dict:
    return json.loads((run / "jetson/units/backend.json").read_text())


def test_serve_on_a_device(run_dir, tmp_path, monkeypatch, capsys):
    from edge.core.artifacts import Manifest

    root = device_root(tmp_path / "root")
    ran = []
    monkeypatch.setattr(serve_mod.Runner, "run", lambda self, step: ran.append(step.argv))
    cfg = JetsonServeConfig(run_dir=str(run_dir), root=str(root), triton_home=str(root / "opt/tritonserver"),
                            backend="tensorrt")
    with pytest.raises(ArtifactError, match="make jetson-engines"):  # no engine served before parity
        serve_mod.main(cfg)
    cfg.backend = "auto"  # no engines yet: the torch backend on CUDA, on the served checkpoint
    assert serve_mod.main(cfg) == 0
    choice = _backend(run_dir)
    assert choice == {"name": "torch_static", "checkpoint": str(Manifest(run_dir).served_checkpoint().resolve()),
                      "device": "cuda", "dtype": "float32", "pipeline": False}
    cfg.torch_pipeline = True
    assert serve_mod.main(cfg) == 0 and _backend(run_dir)["pipeline"] is True  # the served backend reads it
    tri = (run_dir / "jetson/units" / TRITON_UNIT).read_text()
    assert f"Environment=SMARTEXIT_BACKEND_CONFIG={(run_dir / 'jetson/units/backend.json').resolve()}" in tri
    assert "on torch_static" in capsys.readouterr().out
    _parity_passed(run_dir, passed=False)
    with pytest.raises(ArtifactError, match="did not match ONNX Runtime"):  # never served around a failed check
        serve_mod.main(cfg)
    _parity_passed(run_dir)
    assert serve_mod.main(cfg) == 0
    assert _backend(run_dir) == {"name": "tensorrt", "engines_dir": str((run_dir / "jetson/engines").resolve())}
    assert ran[-1] == ["sudo", "systemctl", "enable", "--now", SERVE_UNIT]
    unit = (run_dir / "jetson/units" / SERVE_UNIT).read_text()
    assert "serve.host=127.0.0.1" in unit and "loopback only" in capsys.readouterr().out
    key = tmp_path / "key.yaml"
    key.write_text("serve:\n  api_key: s3cret-Key\n")
    key.chmod(0o600)
    cfg.api_key_config = str(key)
    assert serve_mod.main(cfg) == 0
    unit = (run_dir / "jetson/units" / SERVE_UNIT).read_text()
    assert "serve.host=0.0.0.0" in unit and "s3cret" not in unit


@pytest.mark.parametrize("kw, msg", [(dict(backend="tvm"), "backend 'tvm'"),
                                     (dict(torch_dtype="int4"), "torch_dtype 'int4'")])
def test_bad_serve_settings(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        JetsonServeConfig(**kw)


def test_status_and_stop_dry_runs(tmp_path, capsys):
    assert cli(["jetson", "status", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert f"systemctl is-active {TRITON_UNIT}" in out and "/health" in out
    assert cli(["jetson", "stop", "remove=true", "dry_run=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"sudo systemctl stop {SERVE_UNIT} {TRITON_UNIT}" in lines
    assert f"sudo rm -f /etc/systemd/system/{TRITON_UNIT} /etc/systemd/system/{SERVE_UNIT}" in lines
    assert cli(["jetson", "stop", f"root={tmp_path}"]) == 2
