"""Run, or in a dry run only print, what a Jetson action does.

A dry run prints every command as a shell line (``shlex.join``: paste it into a terminal to run it by
hand) after a ``#`` line saying what it is for, and every file it would write, and touches nothing. A
real run prints the same lines as it goes (as make does) and runs each command through
:func:`edge.core.device.run_command`.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from edge.core import device
from edge.core.artifacts import atomic_write_text
from edge.core.errors import SmartExitError
from edge.jetson.facts import NV_TEGRA_RELEASE, is_jetson

NOT_A_JETSON_EXIT = 2


class NotAJetsonError(SmartExitError):
    """An on-device action on a machine without /etc/nv_tegra_release (exit code 2)."""

    exit_code = NOT_A_JETSON_EXIT


class StepFailed(SmartExitError):
    """A command exited with a code the step does not accept."""


@dataclass(frozen=True)
class Step:
    """One command: what it is for, its argv, how long it may take, which exit codes are success."""

    what: str
    argv: list[str]
    timeout: float = 600.0
    ok: tuple[int, ...] = (0,)
    show: bool = False  # print what it printed (a check's verdict); otherwise only a failure's tail


class Runner:
    """Runs steps (or prints them when ``dry_run``); ``out`` receives the printed lines."""

    def __init__(self, dry_run: bool, out: TextIO | None = None) -> None:
        self.dry_run = dry_run
        self.out = out or sys.stdout

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def note(self, text: str) -> None:
        self.say(f"# {text}")

    def run(self, step: Step) -> subprocess.CompletedProcess | None:
        """Print the step; unless dry, run it.

        Returns:
            The finished process, or None in a dry run.

        Raises:
            StepFailed: the exit code is not in ``step.ok`` (the message has its last output lines).
            SmartExitError: the program is not installed.
        """
        self.note(step.what)
        self.say(shlex.join(step.argv))
        if self.dry_run:
            return None
        try:
            res = device.run_command(step.argv, timeout=step.timeout)
        except subprocess.TimeoutExpired as exc:
            raise StepFailed(f"{step.what}: `{step.argv[0]}` did not finish in {step.timeout:.0f} s") from exc
        if res.returncode not in step.ok:
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
            raise StepFailed(f"{step.what}: `{shlex.join(step.argv[:3])} ...` exited {res.returncode}:\n{tail}")
        if step.show and res.stdout.strip():
            self.say(res.stdout.rstrip())
        return res

    def write(self, path: str | Path, text: str, what: str, mode: int = 0o644) -> None:
        """Write ``text`` atomically (or say that it would)."""
        if self.dry_run:
            self.note(f"would write {path} ({what}, {len(text.encode())} bytes)")
            return
        self.note(f"write {path} ({what})")
        atomic_write_text(path, text)
        os.chmod(path, mode)


def require_jetson(root: str | Path, action: str, runner: Runner) -> bool:
    """Whether ``root`` is a Jetson's root file system.

    Off-device: a dry run says that a real run would stop here and goes on printing (so the whole
    command list can be read on the development machine); a real run raises.

    Raises:
        NotAJetsonError: off-device and not a dry run (exit code 2).
    """
    if is_jetson(root):
        return True
    msg = (f"this machine is not a Jetson (no {Path(root) / NV_TEGRA_RELEASE}): `smartexit jetson {action}` "
           f"runs on the device")
    if runner.dry_run:
        runner.note(f"{msg}; a real run here stops with exit code {NOT_A_JETSON_EXIT}. The commands it would run:")
        return False
    raise NotAJetsonError(msg)
