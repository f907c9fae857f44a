"""`smartexit serve` checks the bundle's hashes before it starts anything: a changed file used to surface as
three failed tritonserver launches and seven tracebacks from Ray Serve's deployment, with the hash error only in
tritonserver's log. Ray is not started here: its init fails the test if it is reached."""
from __future__ import annotations

import json

import pytest

from edge.core.artifacts import sha256_file
from edge.core.errors import ArtifactError
from exporters.triton import BUNDLE_FORMAT
from scheduler.serving.config import REPO_BUNDLE, ServeConfig
from scheduler.serving.stack import free_port, serving_stack


def _repo(run, change: bool):
    bundle = run / "triton" / REPO_BUNDLE
    bundle.mkdir(parents=True)
    (run / "triton" / "smartexit" / "config.pbtxt").write_text('name: "smartexit"\n')
    (bundle / "thresholds.json").write_text('{"lambda": 0.962}')
    sha = sha256_file(bundle / "thresholds.json")
    (bundle / "bundle.json").write_text(json.dumps({"format": BUNDLE_FORMAT, "files": {"thresholds.json": sha}}))
    if change:
        (bundle / "thresholds.json").write_text('{"lambda": 0.100}')


def test_a_changed_bundle_stops_serve_before_ray_starts(tmp_path, monkeypatch):
    import ray

    def no_ray(*a, **k):
        raise AssertionError("Ray was started")
    monkeypatch.setattr(ray, "init", no_ray)
    _repo(tmp_path, change=True)
    with pytest.raises(ArtifactError, match=r"thresholds\.json changed since `smartexit repo` wrote it"):
        with serving_stack(tmp_path, ServeConfig()):
            pass


def test_an_intact_bundle_passes_the_check(tmp_path, monkeypatch):
    import ray

    class Started(Exception):
        pass

    def init(*a, **k):
        raise Started
    monkeypatch.setattr(ray, "init", init)
    _repo(tmp_path, change=False)
    with pytest.raises(Started):  # the check passed and the stack went on to start Ray
        with serving_stack(tmp_path, ServeConfig(port=free_port())):
            pass
