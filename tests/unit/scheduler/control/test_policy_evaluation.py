"""The evaluation's bookkeeping: the best fixed budget per cell, the SLA edge, the learned policy's
ratios, and a small real grid through the simulator."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.control.env import EnvConfig
from scheduler.control.evaluate import (WorkloadSpec, best_fixed, cell_table, compare, evaluate_grid, holds_sla, sla_edge,
                                trace_at_rate)
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import FEATURES, LatencyModel
from scheduler.control.policies import AIMD, FixedBudget
from scheduler.control.workload import Workload


def _cell(goodput, holds, ttft=100.0, std=0.0):
    return {"goodput_rps": goodput, "holds_sla": holds, "ttft_p95_ms": ttft, "goodput_std": std,
            "sla_attainment": 1.0 if holds else 0.5}


def _cells():
    c = {}
    for load, (g16, h16), (g128, h128), (gl, hl) in (
            (0.5, (2.0, True), (2.0, True), (2.0, True)),
            (1.0, (3.5, False), (4.0, True), (4.0, True)),
            (1.5, (3.0, False), (4.5, False), (5.4, True)),
            (2.0, (2.0, False), (3.0, False), (4.5, False))):
        c[("w", load, "fixed-16")] = _cell(g16, h16)
        c[("w", load, "fixed-128")] = _cell(g128, h128)
        c[("w", load, "ppo")] = _cell(gl, hl)
    return c


def test_best_fixed_edge_and_ratios():
    cells, loads = _cells(), [0.5, 1.0, 1.5, 2.0]
    assert best_fixed(cells, "w", 1.0)[0] == "fixed-128"
    assert sla_edge(cells, "w", loads) == 1.0 and sla_edge(cells, "w", loads, "ppo") == 1.5
    cmp = compare(cells, ["w"], loads, "ppo")
    assert cmp["goodput_ratio_vs_best_fixed"]["w"] == pytest.approx(1.0)  # equal at light load
    assert cmp["at_sla_edge"]["w"] == {"load": 1.0, "best_fixed": "fixed-128", "ratio": pytest.approx(1.0)}
    assert cmp["sla_capacity"]["w"]["ratio"] == pytest.approx(1.5)
    assert cmp["per_cell"]["w@2"]["ratio"] == pytest.approx(1.5)


def test_edge_needs_every_lighter_load_to_hold():
    cells = _cells()
    cells[("w", 0.5, "fixed-16")]["holds_sla"] = cells[("w", 0.5, "fixed-128")]["holds_sla"] = False
    cells[("w", 0.5, "fixed-16")]["goodput_rps"] = 2.1  # the best at x0.5 now fails the SLA
    assert sla_edge(cells, "w", [0.5, 1.0, 1.5, 2.0]) is None


def test_no_fixed_policy_is_an_error():
    with pytest.raises(ConfigError, match="no fixed-budget"):
        best_fixed({("w", 1.0, "ppo"): _cell(1, True)}, "w", 1.0)


def test_holds_sla_reads_p95_and_refusals():
    base = {"sla": {"ttft_ms": 500, "tpot_ms": 50}, "errors": 0, "ttft_p95_ms": 400.0, "tpot_p95_ms": 40.0}
    assert holds_sla(base)
    assert not holds_sla({**base, "tpot_p95_ms": 51.0})
    assert not holds_sla({**base, "errors": 1})


def test_trace_rescaled_to_a_rate():
    # dense at first (10 req/s for 10 s), sparse after: the window's own rate is what gets scaled
    t = np.concatenate([np.arange(0.0, 10.0, 0.1), np.arange(10.0, 1000.0, 2.0)])
    w = Workload(t, np.full(t.size, 900), np.full(t.size, 100), "trace x")
    out = trace_at_rate(w, 5.0, 20.0, EnvConfig())
    assert len(out) == 100 and (len(out) - 1) / out.arrival_s[-1] == pytest.approx(5.0)
    assert out.prompt_tokens.max() == 448 and out.output_tokens.max() == 64
    with pytest.raises(ConfigError, match="holds 0 requests"):
        trace_at_rate(w, 5.0, 20.0, EnvConfig(), start_s=5000.0)


def test_a_small_grid_runs_through_the_simulator():
    lm = LatencyModel({f: 0.0 for f in FEATURES} | {"one": 1e-3, "decode_rows": 0.3e-3, "prefill_tokens": 0.15e-3},
                      12, [3, 9, 12])
    ex = ExitModel([3, 9, 12], [0.1, 0.2, 0.7])
    cfg = EnvConfig(capacity_rps=20.0)
    pols = {"fixed-16": lambda: FixedBudget(16, 16), "fixed-512": lambda: FixedBudget(512, 16), "aimd": AIMD}
    rows = evaluate_grid(lm, ex, cfg, [WorkloadSpec("p", "poisson", 3)], [0.5, 1.5], pols, 20.0, seeds=(0, 1))
    assert len(rows) == 2 * 3 * 2
    cells = cell_table(rows)
    assert all(not math.isnan(c["goodput_rps"]) for c in cells.values())
    cmp = compare(cells, ["p"], [0.5, 1.5], "aimd")
    assert 0 < cmp["goodput_ratio_vs_best_fixed_min"] < 2
