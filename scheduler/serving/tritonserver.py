"""Find, start, watch and stop a real ``tritonserver`` on a SmartExit model repository.

Where the binary comes from, in order:
1. ``TRITON_HOME`` (a Triton release tree: ``bin/tritonserver`` + ``backends/``; on a Jetson the
   JetPack tarball from Triton's GitHub release);
2. the ``nvidia-pytriton`` wheel (x86_64 / aarch64 development machines). Its python-backend stub
   is kept per Python version and links the *system* ``libpython3.X.so``; under pyenv or a venv that
   is another interpreter, which breaks at model load (``_recursion_count``). We lay out a backend
   folder with the stub of the running Python and put this interpreter's ``LIBDIR`` first on
   ``LD_LIBRARY_PATH`` (NOTES.md);
3. ``tritonserver`` on ``PATH``, backends in ``/opt/tritonserver/backends``.

The model's ``model.py`` imports ``edge``. The stub's embedded interpreter ignores ``PYTHONPATH``, so
the server's environment gets ``SMARTEXIT_PYTHONPATH`` (this interpreter's site-packages and the
folder that holds the ``edge`` package), which model.py puts first on ``sys.path``.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from edge.core.device import spawn, stop_process
from edge.core.errors import ConfigError, SmartExitError

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    env: dict[str, str]
    source: str  # which of the three places it came from


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls, host: str = LOOPBACK) -> "TritonPorts":
        """Three ports free on ``host`` now (the OS picks them)."""
        socks = [socket.socket() for _ in range(3)]
        try:
            for s in socks:
                s.bind((host, 0))
            return cls(*(s.getsockname()[1] for s in socks))
        finally:
            for s in socks:
                s.close()


def _python_env() -> dict[str, str]:
    """LD_LIBRARY_PATH and PYTHONPATH that make the python-backend stub run this interpreter's packages."""
    import edge

    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             str(Path(edge.__file__).resolve().parents[1])]
    search = os.pathsep.join(dict.fromkeys(p for p in paths + [os.environ.get("PYTHONPATH", "")] if p))
    env = {"SMARTEXIT_PYTHONPATH": search,  # the stub ignores PYTHONPATH: model.py reads this one
           "LD_LIBRARY_PATH": os.pathsep.join(p for p in [libdir, os.environ.get("LD_LIBRARY_PATH", "")] if p)}
    return env


def find_tritonserver(work_dir: Path) -> TritonInstall:
    """The tritonserver to run (module docstring), with the environment it needs.

    Raises:
        SmartExitError: none found; the message says how to get one.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = _python_env()
    home = os.environ.get("TRITON_HOME")
    if home:
        binary, backends = Path(home) / "bin" / "tritonserver", Path(home) / "backends"
        if not binary.is_file():
            raise ConfigError(f"TRITON_HOME={home}: no bin/tritonserver there")
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(Path(home) / "lib"), env["LD_LIBRARY_PATH"]])
        return TritonInstall(binary, backends, env, f"TRITON_HOME={home}")
    try:
        import pytriton
    except ImportError:
        pytriton = None
    if pytriton is not None:
        dist = Path(pytriton.__file__).parent / "tritonserver"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise SmartExitError(f"nvidia-pytriton ships no python-backend stub for Python {version} ({stub})")
        backends = Path(work_dir) / "backends"
        py = backends / "python"
        py.mkdir(parents=True, exist_ok=True)
        for f in (dist / "backends" / "python").iterdir():
            if f.is_file() and not (py / f.name).exists():
                (py / f.name).symlink_to(f)
        if not (py / stub.name).exists():
            shutil.copy2(stub, py / stub.name)
        libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [env["LD_LIBRARY_PATH"], str(libs)] if p)
        return TritonInstall(dist / "bin" / "tritonserver", backends, env, f"nvidia-pytriton wheel ({dist})")
    found = shutil.which("tritonserver")
    if found:
        return TritonInstall(Path(found), Path("/opt/tritonserver/backends"), env, f"PATH ({found})")
    raise SmartExitError("no tritonserver found: pip install nvidia-pytriton (x86_64 / aarch64, glibc >= 2.35), "
                         "or set TRITON_HOME to a Triton release (on a Jetson: the JetPack tarball)")


def tritonserver_command(install: TritonInstall, repo: Path, ports: TritonPorts, host: str = LOOPBACK,
                         log_verbose: int = 0) -> list[str]:
    """The command line that serves ``repo`` on ``host`` (HTTP, gRPC and metrics on ``ports``)."""
    return [str(install.binary), f"--model-repository={repo}", f"--backend-directory={install.backend_dir}",
            f"--http-address={host}", f"--http-port={ports.http}", f"--grpc-address={host}",
            f"--grpc-port={ports.grpc}", "--allow-metrics=true", f"--metrics-address={host}",
            f"--metrics-port={ports.metrics}", "--allow-gpu-metrics=false", "--model-control-mode=none",
            "--exit-on-error=true", "--strict-readiness=true", "--exit-timeout-secs=10",
            f"--log-verbose={log_verbose}"]


def serving_dirs(repo: Path, work_dir: Path | None) -> tuple[Path, Path]:
    """A SmartExit model repository, resolved, and the folder for a server's backends and log (made; default:
    beside the repository), for a tritonserver or a core in process.

    Raises:
        ConfigError: ``repo`` holds no ``smartexit`` model (``smartexit repo`` makes one).
    """
    repo = Path(repo).resolve()
    if not (repo / "smartexit" / "config.pbtxt").is_file():
        raise ConfigError(f"{repo} is not a SmartExit model repository (run `smartexit repo`)")
    work = Path(work_dir or repo.parent / ".tritonserver").resolve()
    work.mkdir(parents=True, exist_ok=True)
    return repo, work


@dataclass
class TritonProcess:
    """One tritonserver serving ``repo``: ``start`` waits for readiness, ``stop`` ends it and its stubs.

    ``restart`` starts it again on the same ports (a supervisor calls it after a crash)."""

    repo: Path
    work_dir: Path | None = None  # backend folder and log; default: beside the repository
    host: str = LOOPBACK
    ports: TritonPorts | None = None
    log_verbose: int = 0
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    _proc: object = field(default=None, repr=False)
    install: TritonInstall | None = None

    def __post_init__(self) -> None:
        self.repo, self.work_dir = serving_dirs(self.repo, self.work_dir)
        self.ports = self.ports or TritonPorts.free(self.host)
        self.install = self.install or find_tritonserver(self.work_dir)

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"tritonserver-{self.ports.grpc}.log"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.ports.http}"

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return tritonserver_command(self.install, self.repo, self.ports, self.host, self.log_verbose)

    def start(self, timeout_s: float = 180.0) -> "TritonProcess":
        """Start the server and wait until it is ready (model loaded).

        Raises:
            SmartExitError: it exited or did not become ready in time (the log's tail is in the message).
        """
        env = {**os.environ, **self.install.env, **self.env}
        self._proc = spawn(self.command(), env=env, log_path=self.log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise SmartExitError(f"tritonserver exited with code {self._proc.returncode}; log "
                                     f"{self.log_path}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise SmartExitError(f"tritonserver not ready after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> int | None:
        if self._proc is None:
            return None
        return stop_process(self._proc)

    def restart(self, timeout_s: float = 180.0) -> "TritonProcess":
        self.stop()
        return self.start(timeout_s)

    def kill(self) -> None:
        """SIGKILL the server alone, as a crash would (tests of the front end's recovery)."""
        if self.alive:
            self._proc.kill()
            self._proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        """The log's errors (lines saying why a model failed to load), then its last ``lines`` lines."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text if line.startswith("E") or "failed to load" in line or "UNAVAILABLE:" in line]
        head = (["errors:"] + errors[:10] + ["last lines:"]) if errors else []
        return "\n".join(head + text[-lines:])

    def __enter__(self) -> "TritonProcess":
        return self.start() if not self.alive else self

    def __exit__(self, *exc) -> None:
        self.stop()
