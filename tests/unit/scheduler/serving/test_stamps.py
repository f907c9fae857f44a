"""The stamps a served request leaves on its way to its first token (scheduler/serving/stamps.py): off unless
named, on in this process and the processes it starts once enabled, one file per process on one shared clock."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.serving import stamps

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.delenv(stamps.ENV, raising=False)
    yield tmp_path / "stamps"
    stamps.enable(None)


def test_without_the_setting_nothing_is_written(folder):
    stamps.enable(None)
    stamps.stamp("ingress_in", "r1")
    assert not stamps.on() and not folder.exists() and stamps.ENV not in os.environ


def test_this_process_and_a_child_stamp_into_one_folder_on_one_clock(folder):
    stamps.enable(folder)
    assert stamps.on() and os.environ[stamps.ENV] == str(folder)
    t0 = time.monotonic() * 1e3
    stamps.stamp("client_send", "r1")
    subprocess.run([sys.executable, "-c", "from scheduler.serving.stamps import stamp; stamp('ingress_in')"],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    stamps.stamp("client_first", "r1")
    t1 = time.monotonic() * 1e3
    files = sorted(folder.glob("*.tsv"))
    assert len(files) == 2 and f"{os.getpid()}.tsv" in {f.name for f in files}
    lines = [line.split("\t") for f in files for line in f.read_text().splitlines()]
    assert sorted((p, k) for p, k, _ in lines) == [("client_first", "r1"), ("client_send", "r1"), ("ingress_in", "")]
    by_point = {p: float(t) for p, _, t in lines}
    assert t0 <= by_point["client_send"] <= by_point["ingress_in"] <= by_point["client_first"] <= t1
    stamps.enable(None)
    stamps.stamp("client_send", "r2")
    assert stamps.ENV not in os.environ and len(folder.joinpath(f"{os.getpid()}.tsv").read_text().splitlines()) == 2
