"""Serving fixtures: a run with an export, a threshold table and a Triton repository, and the helpers
the serving tests share (a free port, a private copy of the repository, the processes serving it).

The run is built once per session from ``micro_run`` (tests/conftest.py): export, calibrate and
``smartexit repo`` with the smallest settings that still certify a table (~25 s on 2 cores, after
``micro_run``'s ~10 s distill).
"""
from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = "triton"  # `smartexit repo` writes <run>/triton
PROCESS_NAMES = ("tritonserver", "triton_python_backend_stub")


@pytest.fixture(scope="session")
def served_run(micro_run, tmp_path_factory) -> Path:
    """A copy of ``micro_run`` with its ONNX export, threshold table and Triton repository."""
    from edge.pipeline.cli import main as cli

    run = tmp_path_factory.mktemp("served") / "run"
    shutil.copytree(micro_run, run)
    assert cli(["export", f"run_dir={run}", "threads=1", "prompt_tokens=16", "parity_prompts=2"]) == 0
    assert cli(["calibrate", f"run_dir={run}", "epsilon=0.2", "fit_units=16", "certify_units=32",
                "propagate_units=32", "eval_units=4", "prompt_tokens=16", "new_tokens=6", "batch=16",
                "threads=1"]) == 0
    # the step gate and bounded requests' drafts off (served by default): the tests compare served tokens and exit
    # layers with the engine in process, which with them would depend on what each measured cheaper at that moment
    assert cli(["repo", f"run_dir={run}", "exit_gate=false", "bounded_drafts=false"]) == 0
    assert (run / REPO / "smartexit" / "config.pbtxt").is_file()
    return run


def copy_repository(run: Path, dest: Path) -> Path:
    """A run folder at ``dest`` holding a private copy of ``run``'s Triton repository (new files, not
    hard links, so editing one cannot touch the run); returns ``dest``.

    Each test module serves its own copy, so the processes it looks for (by repository path) are
    its own and not another module's or another session's."""
    shutil.copytree(run / REPO, dest / REPO, ignore=shutil.ignore_patterns("__pycache__", ".ort_cache"))
    return dest


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function returning a TCP port free on 127.0.0.1 now (the OS picks it): the stack's own."""
    from scheduler.serving.stack import free_port as pick
    return pick


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str
    argv: tuple[str, ...]

    def arg(self, prefix: str) -> str | None:
        """The value of ``--prefix=value`` on the command line, if present."""
        return next((a[len(prefix) + 1:] for a in self.argv if a.startswith(prefix + "=")), None)


def serving_processes(repo: Path) -> list[Proc]:
    """Live tritonserver and python-backend stub processes serving ``repo`` (read from /proc).

    A tritonserver names the repository as ``--model-repository=<repo>``; its stub as the path of the
    model's ``model.py`` inside it. Zombies (exited, not yet reaped) do not count."""
    repo = str(Path(repo).resolve())
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = tuple(a.decode(errors="replace") for a in
                         Path(entry.path, "cmdline").read_bytes().split(b"\0") if a)
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if not argv or state == "Z":
            continue
        name = os.path.basename(argv[0])
        if name not in PROCESS_NAMES:
            continue
        if f"--model-repository={repo}" in argv or any(a.startswith(repo + os.sep) for a in argv[1:]):
            found.append(Proc(int(entry.name), name, argv))
    return found


def listener(port: int) -> str | None:
    """The command line of the process listening on TCP ``port`` on IPv4 (from /proc/net/tcp and the
    processes' socket descriptors), or None: nothing listens there, or its owner is not ours to read."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "0A":  # local port, state LISTEN
            inodes.add(f"socket:[{f[9]}]")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = [os.readlink(os.path.join(entry.path, "fd", fd)) for fd in os.listdir(os.path.join(entry.path, "fd"))]
        except OSError:
            continue
        if inodes & set(fds):
            return Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return None


def _address(hexaddr: str) -> str:
    """An address of /proc/net/tcp{,6} (hex, in the kernel's byte order) as text; port dropped."""
    raw = bytes.fromhex(hexaddr.split(":")[0])
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def descendant_listeners(root: int) -> list[tuple[str, int, str]]:
    """(address, pid, command) of every listening TCP socket (IPv4 and IPv6) held by a process descended
    from ``root`` (read from /proc: the parent links, the socket tables and each process's descriptors)."""
    listening: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                listening[f"socket:[{f[9]}]"] = _address(f[1])
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = []
    for pid in parent:
        p = pid
        while p not in (0, 1, root) and p in parent:
            p = parent[p]
        if p != root or pid == root:
            continue
        try:
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        # The program's own name first, not its path: a checkout's path is of any length (CI's is longer).
        cmd = " ".join([Path(argv[0]).name, *argv[1:]]).strip()[:80]
        found += [(listening[fd], pid, cmd) for fd in fds if fd in listening]
    return found


@pytest.fixture(scope="session")
def find_descendant_listeners() -> Callable[[int], list[tuple[str, int, str]]]:
    """:func:`descendant_listeners` as a fixture."""
    return descendant_listeners


@pytest.fixture(scope="session")
def find_listener() -> Callable[[int], str | None]:
    """:func:`listener` as a fixture."""
    return listener


@pytest.fixture(scope="session")
def find_processes() -> Callable[[Path], list[Proc]]:
    """:func:`serving_processes` as a fixture (test modules do not import conftest)."""
    return serving_processes


@pytest.fixture(scope="session")
def repository_copy() -> Callable[[Path, Path], Path]:
    """:func:`copy_repository` as a fixture."""
    return copy_repository
