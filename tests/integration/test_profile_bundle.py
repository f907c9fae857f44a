"""``smartexit profile`` on a real serving bundle (ONNX Runtime, the calibrated rule): the demo run's when
``make demo`` has made it, else the session's served micro run (tests/integration/conftest.py).

The profile runs in a process of its own, as the CLI does: ONNX Runtime's thread pool belongs to the
process and is sized by its first session (edge/runtime/ortsession.py), and in a test session an earlier
stage has made it one thread per core, which is not the bundle's setting the profile should measure."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge.core.artifacts import Manifest
from edge.core.errors import ConfigError
from scheduler.control.latency import LatencyModel
from scheduler.control.predictor import read_exit_traces
from edge.pipeline.profile import main
from scheduler.loadtest.profile_config import ProfileConfig

pytestmark = pytest.mark.integration

DEMO_BUNDLE = Path("artifacts/demo/triton/smartexit/1/bundle")


@pytest.fixture(scope="module")
def bundle(request) -> Path:
    if (DEMO_BUNDLE / "bundle.json").is_file():
        return DEMO_BUNDLE.resolve()
    return request.getfixturevalue("served_run") / "triton" / "smartexit" / "1" / "bundle"


def test_profile_fits_the_engine(bundle, tmp_path):
    run = tmp_path / "run"
    cli = Path(sys.executable).with_name("smartexit")
    proc = subprocess.run([str(cli), "profile", f"run_dir={run}", f"bundle={bundle}", "scenarios=12",
                           "steps_per_scenario=40", "warmup_steps=5", "serving=false"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = run / "scheduler"
    model = LatencyModel.load(out / "latency.json")
    # loose: single steps on a shared 2-core box are noisy (the fit itself is checked in the unit tests).
    # The micro model's steps take well under a millisecond, so their jitter is of their size: there the
    # mean step per held-out scenario (what a simulator's averages see) is checked instead.
    key = "test_rel_err_median" if bundle == DEMO_BUNDLE.resolve() else "test_scenario_mean_rel_err_median"
    assert model.fit[key] < 0.5, proc.stdout
    assert model.fit["points"] == 480 and model.fit["scenarios"] == 12
    prof = json.loads((out / "profile.json").read_text())
    assert len(prof["steps"]) == 480 and {s["group"] for s in prof["steps"]} == set(range(12))
    assert sum(prof["exit_fractions"].values()) == pytest.approx(1.0)
    traces = read_exit_traces(out / "exit_traces.json")  # the exit-depth predictor's reader validates them
    assert any(all(t["exits_allowed"]) for t in traces)  # the trace phase decoded where rows may exit
    assert all(e in model.exit_layers for t in traces for e in t["exit_layers"])
    assert "held-out" in (out / "profile.md").read_text().lower()
    rec = Manifest(run).stage("profile")
    assert rec["metrics"]["test_rel_err_median"] == model.fit["test_rel_err_median"]
    Manifest(run).verified_output("profile", "latency")


@pytest.mark.parametrize("kw,message", [(dict(scenarios=1, steps_per_scenario=40), "one scenario"),
                                        (dict(scenarios=2, steps_per_scenario=3), "too small to fit")])
def test_too_small_a_profile_is_refused(bundle, tmp_path, kw, message):
    cfg = ProfileConfig(run_dir=str(tmp_path), bundle=str(bundle), warmup_steps=0, trace_steps=0, **kw)
    with pytest.raises(ConfigError, match=message):  # fit_latency's own message
        main(cfg)
    assert not (tmp_path / "scheduler").exists() and not (tmp_path / "manifest.json").exists()
