"""``smartexit jetson serve`` / ``status`` / ``stop``: ``make jetson-serve`` / ``-status`` / ``-stop``, on the device.

``serve`` writes the two systemd units (:mod:`edge.jetson.units`) into ``<run>/jetson/units/``,
installs them into ``/etc/systemd/system`` and starts them (``enable --now``: they also start at boot).
The model runs on the TensorRT engines of ``make jetson-engines`` once their parity against ONNX Runtime
passed for this export; before any engine exists, on the torch backend on CUDA with CUDA graphs
(``torch_static``, JetPack's torch wheel); engines that failed parity stop it (:func:`choose_backend`).
The choice is ``<run>/jetson/units/backend.json``, which tritonserver's unit names in
``SMARTEXIT_BACKEND_CONFIG`` (scheduler.serving.bundle). The serving app binds 127.0.0.1 unless ``api_key_config`` names a YAML
file holding ``serve: {api_key: ...}`` (mode 0600), then 0.0.0.0 with the key required on every
``/v1/*`` request (docs/serving.md).
"""
from __future__ import annotations

import getpass
import json
import os
import stat
import sys
import sysconfig
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.core.artifacts import Manifest
from edge.core.configio import load_yaml
from edge.core.errors import ArtifactError, ConfigError
from edge.jetson import commands
from edge.jetson.check import DEFAULT_TRITON_HOME
from edge.jetson.engines import PARITY_JSON
from edge.jetson.push import REPO_ROOT
from edge.jetson.steps import Runner, Step, require_jetson
from edge.jetson.units import ANY, LOOPBACK, SERVE_UNIT, TRITON_UNIT, UNITS, serve_unit, triton_environment, triton_unit
from edge.runtime.served import BACKEND_ENV, CHOICE_FILE, ENGINES_DIR, SERVED_BACKENDS
from scheduler.serving.tritonserver import TritonPorts

UNITS_DIR = Path("jetson") / "units"


@dataclass
class JetsonServeConfig:
    """``smartexit jetson serve``: install and start tritonserver + the Ray Serve app as systemd units."""

    run_dir: str = "artifacts/demo"
    root: str = "/"
    triton_home: str | None = None  # the JetPack tarball's tree; default $TRITON_HOME, else /opt/tritonserver
    port: int = 8000  # the OpenAI-compatible API and /dashboard
    triton_http_port: int = 8010  # tritonserver, loopback only (8000 is the API's)
    triton_grpc_port: int = 8001
    triton_metrics_port: int = 8002
    api_key_config: str | None = None  # YAML with serve.api_key (mode 0600): then bind 0.0.0.0
    user: str | None = None  # the units' User= (default: whoever runs this)
    power_meter: str = "auto"  # the dashboard's power chart (jtop on a Jetson)
    backend: str = "auto"  # auto | tensorrt | torch_static | onnxruntime (choose_backend)
    torch_dtype: str = "float32"  # torch_static's: the function calibration certified (float16 / bfloat16: faster)
    # torch_static's: launch each decode segment before the exit's decision is read (docs/runtime.md: pays where
    # few rows leave at each check; wastes a segment where one does; off until measured with a calibrated rule)
    torch_pipeline: bool = False
    unit_dir: str = commands.SYSTEMD_DIR
    dry_run: bool = False

    def __post_init__(self) -> None:
        ports = (self.port, self.triton_http_port, self.triton_grpc_port, self.triton_metrics_port)
        if len(set(ports)) != 4 or not all(0 < p < 65536 for p in ports):
            raise ConfigError(f"jetson serve: port, triton_http_port, triton_grpc_port, triton_metrics_port must be "
                              f"four different ports in 1..65535, got {ports}")
        if self.backend not in ("auto", *SERVED_BACKENDS):
            raise ConfigError(f"jetson serve: backend {self.backend!r} is not auto or one of {', '.join(SERVED_BACKENDS)}")
        if self.torch_dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"jetson serve: torch_dtype {self.torch_dtype!r} is not float32, float16 or bfloat16")


@dataclass
class JetsonServiceConfig:
    """``smartexit jetson status`` / ``stop``: the units ``jetson serve`` installed."""

    root: str = "/"
    port: int = 8000  # where status asks /health
    disable: bool = False  # stop: also disable (no start at boot)
    remove: bool = False  # stop: also remove the unit files
    unit_dir: str = commands.SYSTEMD_DIR
    dry_run: bool = False


def check_parity_passed(run_dir: Path, manifest: Manifest) -> None:
    """Raises ArtifactError unless ``jetson/device/parity.json`` passed for the export in the manifest."""
    path = run_dir / PARITY_JSON
    try:
        parity = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: no engine parity result ({exc}); run `make jetson-engines` first: no engine is "
                            f"served before it matches ONNX Runtime") from exc
    want = manifest.stage("export")["outputs"]["graphs"]["sha256"]
    if parity.get("graphs_sha256") != want:
        raise ArtifactError(f"{path}: the parity result is of another export; run `make jetson-engines` again")
    if parity.get("passed") is not True:
        raise ArtifactError(f"{path}: the engines did not match ONNX Runtime; nothing is served (see that file)")


def choose_backend(cfg: JetsonServeConfig, run_dir: Path, manifest: Manifest, runner: Runner) -> dict[str, Any]:
    """What serves the bundle (scheduler.serving.bundle.read_backend_choice's dict).

    ``tensorrt``: the engines of ``make jetson-engines``, only once their parity against ONNX Runtime
    passed for this export. ``torch_static``: the served checkpoint (pushed with ``bench=true``) on
    CUDA with CUDA graphs, the path before engines exist. ``auto``: tensorrt where parity passed,
    torch_static where no engines were built; engines that failed parity or belong to another export
    stop it (a failed check is never served around)."""
    name = cfg.backend
    if name in ("auto", "tensorrt"):
        try:
            check_parity_passed(run_dir, manifest)
            name = "tensorrt"
        except ArtifactError as exc:
            missing = not (run_dir / PARITY_JSON).exists()
            if name == "auto" and missing:
                runner.note(f"no TensorRT engines yet ({run_dir / PARITY_JSON} is missing): serving the torch backend "
                            f"on CUDA with CUDA graphs (torch_static); `make jetson-engines` then `make jetson-serve` "
                            f"switches to the engines")
                name = "torch_static"
            elif cfg.dry_run:
                runner.note(f"a real run would refuse: {exc}")
                name = "tensorrt"
            else:
                raise
    if name == "tensorrt":
        return {"name": "tensorrt", "engines_dir": str((run_dir / ENGINES_DIR).resolve())}
    if name == "torch_static":
        try:
            ckpt = manifest.served_checkpoint().resolve()
        except ArtifactError as exc:
            if not cfg.dry_run:
                raise ArtifactError(f"torch_static loads the served checkpoint ({exc}); push it with "
                                    f"`make jetson-push` (bench=true, the default)") from exc
            runner.note(f"a real run would refuse: {exc}")
            ckpt = run_dir / "<served checkpoint>"
        return {"name": "torch_static", "checkpoint": str(ckpt), "device": "cuda", "dtype": cfg.torch_dtype,
                "pipeline": cfg.torch_pipeline}
    return {"name": "onnxruntime"}


def check_api_key_config(path: str | Path) -> Path:
    """The API-key YAML: it exists, only its owner may read it, and it sets ``serve.api_key``.

    Raises:
        ConfigError: naming the file and what is wrong (never the key).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"api_key_config {path} does not exist (a YAML file: `serve: {{api_key: ...}}`, chmod 600)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"api_key_config {path} is readable by others (mode {mode:o}): chmod 600 {path}")
    try:  # read as `smartexit serve --config` reads it: an unquoted 0x1F is the text written
        key = load_yaml(path).get("serve", {}).get("api_key")
    except (ConfigError, AttributeError) as exc:
        raise ConfigError(f"api_key_config {path}: not a YAML mapping with serve.api_key "
                          f"({type(exc).__name__})") from exc
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"api_key_config {path}: serve.api_key must be a non-empty string")
    return path.resolve()


def main(cfg: JetsonServeConfig) -> int:
    runner = Runner(cfg.dry_run)
    require_jetson(cfg.root, "serve", runner)
    run_dir = Path(cfg.run_dir)
    manifest = Manifest(run_dir)
    repo = manifest.verified_output("repo", "repository").resolve()
    backend = choose_backend(cfg, run_dir, manifest, runner)
    key_config = check_api_key_config(cfg.api_key_config) if cfg.api_key_config else None
    host = ANY if key_config else LOOPBACK
    triton_home = Path(cfg.triton_home or os.environ.get("TRITON_HOME") or DEFAULT_TRITON_HOME)
    if not (triton_home / "bin" / "tritonserver").is_file():
        msg = (f"{triton_home}/bin/tritonserver not found: extract the Jetson tarball of Triton there (or "
               f"triton_home=DIR); `make jetson-check` says which release")
        if not cfg.dry_run:
            raise ConfigError(msg)
        runner.note(f"a real run would refuse: {msg}")
    user = cfg.user or getpass.getuser()
    paths = sysconfig.get_paths()
    env = triton_environment(triton_home, [paths["purelib"], paths["platlib"]], REPO_ROOT,
                             sysconfig.get_config_var("LIBDIR") or "")
    units_dir = run_dir / UNITS_DIR
    choice_path = (run_dir / CHOICE_FILE).resolve()
    runner.write(choice_path, json.dumps(backend, indent=2) + "\n", f"the serving backend: {backend['name']}")
    env[BACKEND_ENV] = str(choice_path)
    ports = TritonPorts(cfg.triton_http_port, cfg.triton_grpc_port, cfg.triton_metrics_port)
    texts = {
        TRITON_UNIT: triton_unit(user=user, triton_home=triton_home, repository=repo, ports=ports, env=env,
                                 workdir=REPO_ROOT),
        SERVE_UNIT: serve_unit(user=user, workdir=REPO_ROOT, smartexit=Path(sys.executable).parent / "smartexit",
                               run_dir=run_dir.resolve(), host=host, port=cfg.port,
                               triton_grpc=f"{LOOPBACK}:{cfg.triton_grpc_port}", api_key_config=key_config,
                               power_meter=cfg.power_meter),
    }
    for name, text in texts.items():
        runner.write(units_dir / name, text, "systemd unit")
    for name in UNITS:
        runner.run(Step(f"install {name}", commands.install_unit_argv(units_dir / name, cfg.unit_dir)))
    runner.run(Step("systemd reads the new units", commands.systemctl_argv("daemon-reload")))
    for name, what in ((TRITON_UNIT, "tritonserver"), (SERVE_UNIT, "the serving app")):
        runner.run(Step(f"start {what} (and at every boot)", commands.systemctl_argv("enable", "--now", name)))
    where = f"http://{'<this device>' if host == ANY else LOOPBACK}:{cfg.port}"
    what = (f"{run_dir} on {backend['name']} at {where}/v1 (dashboard {where}/dashboard)"
            f"{'; the API key is required' if key_config else ', loopback only'}")
    if cfg.dry_run:
        runner.note(f"would serve {what}")
    else:
        print(f"serving {what}; make jetson-status to follow it")
    return 0


def _health(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/health", timeout=5) as r:
            return f"{r.status} {r.read(200).decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer ({exc})"


def status(cfg: JetsonServiceConfig) -> int:
    """Both units active and /health answering: exit 0; otherwise 1 (what is down is printed)."""
    runner = Runner(cfg.dry_run)
    require_jetson(cfg.root, "status", runner)
    active = {}
    for name in UNITS:
        res = runner.run(Step(f"is {name} running", commands.systemctl_is_active_argv(name), ok=tuple(range(256))))
        active[name] = None if res is None else res.stdout.strip()
    res = runner.run(Step("their state and last log lines", commands.systemctl_status_argv(list(UNITS)),
                          ok=tuple(range(256))))
    if cfg.dry_run:
        runner.note(f"would ask http://{LOOPBACK}:{cfg.port}/health")
        return 0
    print(res.stdout)
    health = _health(cfg.port)
    for name, state in active.items():
        print(f"{name}: {state}")
    print(f"GET /health on port {cfg.port}: {health}")
    return 0 if all(s == "active" for s in active.values()) and health.startswith("200") else 1


def stop(cfg: JetsonServiceConfig) -> int:
    """Stop the serving app, then tritonserver; ``disable`` / ``remove`` undo ``jetson serve`` further."""
    runner = Runner(cfg.dry_run)
    require_jetson(cfg.root, "stop", runner)
    runner.run(Step("stop the serving app, then tritonserver (5: not installed)",
                    commands.systemctl_argv("stop", SERVE_UNIT, TRITON_UNIT), ok=(0, 5)))
    if cfg.disable or cfg.remove:
        runner.run(Step("no start at boot", commands.systemctl_argv("disable", SERVE_UNIT, TRITON_UNIT)))
    if cfg.remove:
        runner.run(Step("remove the unit files", commands.remove_units_argv(list(UNITS), cfg.unit_dir)))
        runner.run(Step("systemd forgets them", commands.systemctl_argv("daemon-reload")))
    if not cfg.dry_run:
        print("stopped " + ", ".join(UNITS))
    return 0
