"""The systemd units that serve a run on a Jetson: text from pure functions (systemd.service(5)).

- ``smartexit-triton.service``: JetPack's tritonserver (the Jetson tarball, ``--backend-directory``
  given explicitly, as Triton's Jetson docs require) on the run's model repository, HTTP / gRPC /
  metrics on loopback only. Its python-backend model imports ``edge``: the environment carries
  ``SMARTEXIT_PYTHONPATH`` (the stub ignores PYTHONPATH; scheduler/serving/tritonserver.py) and the library
  folders of Triton and of the venv's Python.
- ``smartexit-serve.service``: the Ray Serve app (``smartexit serve``) connected to that tritonserver
  (``serve.triton_url``), on 127.0.0.1 unless an API key is configured. The key never appears in a
  unit file or on a command line: ``--config FILE`` names a YAML file (``serve: {api_key: ...}``,
  mode 0600, owned by the service's user) that ``smartexit serve`` reads.

Both restart on failure; stopping the serve unit leaves tritonserver up, stopping tritonserver stops
the serve unit too (``Requires=`` + ``After=``, systemd.unit(5)).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Sequence

from scheduler.serving.tritonserver import TritonInstall, TritonPorts, tritonserver_command

TRITON_UNIT = "smartexit-triton.service"
SERVE_UNIT = "smartexit-serve.service"
UNITS = (TRITON_UNIT, SERVE_UNIT)
LOOPBACK = "127.0.0.1"
ANY = "0.0.0.0"
_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def systemd_word(arg: str) -> str:
    """One command-line word as systemd reads it (systemd.service(5), "Command lines"): double-quoted
    with backslash escapes where it holds anything but plain characters; '%' (specifiers) and '$'
    (environment substitution) doubled so they stay literal."""
    word = str(arg)
    if not _PLAIN.fullmatch(word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word.replace("%", "%%").replace("$", "$$")


def exec_line(argv: Sequence[str]) -> str:
    """``argv`` as an ExecStart= value; the program must be an absolute path.

    Raises:
        ValueError: a relative program path.
    """
    if not Path(argv[0]).is_absolute():
        raise ValueError(f"systemd needs an absolute program path, got {argv[0]!r}")
    return " ".join(systemd_word(a) for a in argv)


def environment_lines(env: Mapping[str, str]) -> list[str]:
    """Environment= lines (quoted where needed; '%' doubled, '$' is not expanded there)."""
    return [f"Environment={systemd_word(f'{k}={v}').replace('$$', '$')}" for k, v in sorted(env.items())]


def path_value(path: str | Path) -> str:
    """A path setting such as WorkingDirectory= (no quoting there; '%' starts a specifier)."""
    return str(path).replace("%", "%%")


def triton_environment(triton_home: str | Path, site_dirs: Sequence[str], repo_root: str | Path,
                       python_libdir: str) -> dict[str, str]:
    """What the python-backend stub needs: this venv's packages and the checkout (``SMARTEXIT_PYTHONPATH``,
    read by the Triton model.py) and the libraries of Triton and of this Python (``LD_LIBRARY_PATH``),
    as scheduler/serving/tritonserver.py sets them for a server it launches itself."""
    paths = list(dict.fromkeys([*site_dirs, str(repo_root)]))
    libs = [str(Path(triton_home) / "lib"), *([python_libdir] if python_libdir else [])]
    return {"SMARTEXIT_PYTHONPATH": ":".join(paths), "LD_LIBRARY_PATH": ":".join(libs)}


def triton_unit(*, user: str, triton_home: str | Path, repository: str | Path, ports: TritonPorts,
                env: Mapping[str, str], workdir: str | Path) -> str:
    """``smartexit-triton.service``: tritonserver from ``triton_home`` (bin/, lib/, backends/) on loopback."""
    home = Path(triton_home)
    install = TritonInstall(home / "bin" / "tritonserver", home / "backends", dict(env), f"JetPack tarball {home}")
    argv = tritonserver_command(install, Path(repository), ports, LOOPBACK)
    return _unit(f"SmartExit: tritonserver (JetPack release, {home}) on {repository}", user, workdir,
                 environment_lines(env), argv, stop_timeout_s=30)


def serve_unit(*, user: str, workdir: str | Path, smartexit: str | Path, run_dir: str | Path, host: str, port: int,
               triton_grpc: str, api_key_config: str | Path | None, power_meter: str = "auto") -> str:
    """``smartexit-serve.service``: the Ray Serve OpenAI-compatible app (and ``/dashboard``) on ``host:port``.

    Raises:
        ValueError: a host other than loopback without an API key config (the serving app refuses it
            too: docs/serving.md).
    """
    if host not in (LOOPBACK, "localhost", "::1") and api_key_config is None:
        raise ValueError(f"serving on {host} needs an API key (api_key_config); without one it binds {LOOPBACK}")
    argv = [str(smartexit), "serve", *(["--config", str(api_key_config)] if api_key_config else []),
            f"run_dir={run_dir}", f"serve.host={host}", f"serve.port={port}", f"serve.triton_url={triton_grpc}",
            f"serve.power_meter={power_meter}"]
    return _unit(f"SmartExit: Ray Serve OpenAI-compatible API and dashboard on {host}:{port}", user, workdir,
                 ["Environment=PYTHONUNBUFFERED=1"], argv, stop_timeout_s=60, requires=TRITON_UNIT)


def _unit(description: str, user: str, workdir: str | Path, env_lines: list[str], argv: Sequence[str],
          stop_timeout_s: int, requires: str | None = None) -> str:
    """A simple service unit started at boot after the network (and after the unit it ``requires``),
    restarted on failure."""
    return "\n".join([
        "[Unit]",
        f"Description={description}",
        *([f"Requires={requires}"] if requires else []),
        f"After={requires + ' ' if requires else ''}network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        f"WorkingDirectory={path_value(workdir)}",
        *env_lines,
        f"ExecStart={exec_line(argv)}",
        "Restart=on-failure",
        "RestartSec=5",
        f"TimeoutStopSec={stop_timeout_s}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])
