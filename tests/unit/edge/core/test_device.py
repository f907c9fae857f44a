"""Device seam: pure command builders and L4T parsing (real device checks are in tests/jetson)."""
from __future__ import annotations

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
