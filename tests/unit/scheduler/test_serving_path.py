"""The serving path's fit recovers what it measures: results made by the simulator with a known
slowdown and overheads give those numbers back; too few results are refused."""
from __future__ import annotations

import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.latency import FEATURES, LatencyModel
from scheduler.policies import FixedBudget
from scheduler.serving_path import ServingPath, fit_serving_path
from scheduler.sim import ExitModel, SimConfig, simulate
from scheduler.workload import Arrivals, Workload, synthetic

LM = LatencyModel({f: 0.0 for f in FEATURES} | {"one": 1e-3, "decode_rows": 0.4e-3, "prefill_tokens": 0.2e-3,
                                                 "prefill_calls": 1e-3}, 12, [3, 9, 12])
EX = ExitModel([3, 9, 12], [0, 0, 1])


def _results(w: Workload, **cfg):
    return simulate(LM, EX, SimConfig(**cfg), w, FixedBudget(128, 16)).results()


def test_fit_recovers_overheads_and_slowdown(tmp_path):
    truth = dict(ttft_overhead_ms=20.0, token_overhead_ms=3.0, engine_slowdown=1.6)
    probes_w = Workload(np.arange(6) * 60.0, np.full(6, 100), np.full(6, 20), "probes")
    load_w = synthetic(200, 25.0, Arrivals.POISSON, seed=3, prompt_mean=120, output_mean=24)
    probes, load = _results(probes_w, **truth), _results(load_w, **truth)
    sp = fit_serving_path(LM, EX, SimConfig(), probes, load, 128)
    # one request alone: the slowdown also stretches its steps, so the probes' overheads absorb a little
    assert sp.ttft_overhead_ms == pytest.approx(20.0, abs=2.0) and sp.token_overhead_ms == pytest.approx(3.0, abs=1.0)
    assert sp.engine_slowdown == pytest.approx(1.6, rel=0.1)
    sp.save(tmp_path / "serving.json")
    assert ServingPath.load(tmp_path / "serving.json") == sp and ServingPath.load(tmp_path / "none.json") is None


def test_too_few_results_are_refused():
    with pytest.raises(ConfigError, match="need 1 and 4"):
        fit_serving_path(LM, EX, SimConfig(), [], [], 128)
