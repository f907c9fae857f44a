"""The device seam: one ``run_command`` for external programs, and Jetson (L4T) detection.

Command lines are built by pure functions so tests can compare them as lists.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from edge.core.errors import SmartExitError

TEGRA_RELEASE = Path("/etc/nv_tegra_release")


def run_command(argv: list[str], timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run an external program (trtexec, tegrastats, tritonserver, ...); a missing binary is a clear error."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise SmartExitError(f"{argv[0]} is not installed or not on PATH") from exc


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child is killed when the process that started it dies (no orphan servers). SIGKILL, not
    SIGTERM: a tritonserver whose graceful shutdown hung took five SIGTERMs and stayed, orphaned, after a
    fresh-clone demo (stop 66); nothing is left to wait for its graceful exit once its parent is gone (its
    python-backend stubs leave within seconds of it)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass  # not glibc Linux: the parent's stop() still ends it


def spawn(argv: list[str], env: dict[str, str] | None = None, log_path: Path | None = None) -> subprocess.Popen:
    """Start a long-running external program (tritonserver, tegrastats) in its own process group, its
    output to ``log_path``; it is killed if this process dies first. Stop it with :func:`stop_process`
    (SIGTERM, then SIGKILL)."""
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
    except FileNotFoundError as exc:
        raise SmartExitError(f"{argv[0]} is not installed or not on PATH") from exc
    finally:
        if log_path is not None:
            out.close()


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM the process group, SIGKILL it after ``timeout`` s; returns the exit code."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # children left in the group (a python-backend stub) go too
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.poll()


@dataclass(frozen=True)
class L4TRelease:
    major: int
    revision: str  # e.g. "4.3"

    @property
    def version(self) -> str:
        return f"{self.major}.{self.revision}"

    @property
    def jetpack(self) -> str:
        """JetPack line for this L4T (NVIDIA's L4T archive): r36 -> JetPack 6, r35 -> 5, r38 -> 7."""
        return {35: "5.x", 36: "6.x", 38: "7.x"}.get(self.major, "unknown")


def parse_l4t_release(text: str) -> L4TRelease:
    """Parse ``/etc/nv_tegra_release``: '# R36 (release), REVISION: 4.3, GCID: ...'.

    The leading '#' is optional: some tools quote the line without it (tegra-exporter's tests do)."""
    m = re.search(r"(?:^|#)\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)", text, re.MULTILINE)
    if not m:
        raise SmartExitError(f"unrecognised nv_tegra_release content: {text[:80]!r}")
    return L4TRelease(int(m.group(1)), m.group(2).rstrip("."))


def dpkg_query_argv(package_glob: str) -> list[str]:
    return ["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", package_glob]


def jetson_info() -> dict[str, str]:
    """L4T / JetPack and TensorRT package versions on a Jetson; an error elsewhere."""
    if not TEGRA_RELEASE.exists():
        raise SmartExitError(f"{TEGRA_RELEASE} not found: this is not a Jetson (L4T) device")
    rel = parse_l4t_release(TEGRA_RELEASE.read_text())
    out = {"l4t": rel.version, "jetpack": rel.jetpack}
    res = run_command(dpkg_query_argv("*nvinfer*"))
    if res.returncode == 0:
        for line in res.stdout.splitlines():
            name, _, ver = line.partition(" ")
            if name in ("libnvinfer10", "libnvinfer8", "tensorrt"):
                out[name] = ver
    return out
