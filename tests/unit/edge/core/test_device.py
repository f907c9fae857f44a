"""Device seam: pure command builders and L4T parsing (real device checks are in tests/jetson)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge.core.device import dpkg_query_argv, parse_l4t_release, run_command
from edge.core.errors import SmartExitError


def test_parse_l4t_release():
    rel = parse_l4t_release("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n")
    assert rel.version == "36.4.3" and rel.jetpack == "6.x"
    with pytest.raises(SmartExitError, match="unrecognised"):
        parse_l4t_release("hello")


def test_dpkg_query_argv():
    assert dpkg_query_argv("*nvinfer*") == ["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", "*nvinfer*"]


def test_run_command_missing_binary():
    with pytest.raises(SmartExitError, match="not installed"):
        run_command(["definitely-not-a-real-binary-xyz"])
    assert run_command(["true"]).returncode == 0


# a parent that spawns a program which ignores SIGTERM (as a tritonserver whose graceful shutdown hangs does),
# prints its pid and waits to be killed
_PARENT = """
import sys, time
from edge.core.device import spawn
child = spawn([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                    "time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_spawned_program_dies_with_its_parent_even_if_it_ignores_sigterm():
    """A server started by ``spawn`` whose parent is SIGKILLed (a Ray replica ended at once, before it could stop
    its server) does not stay behind as an orphan, even when it would not exit on SIGTERM."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[4])  # the repository: edge imports
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # the child has set its signal handler
    os.kill(child, 0)  # alive
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the spawned program outlived its parent")
