"""The scheduler benchmark's judgement of the simulator and of the SLA (scheduler/loadtest/bench_scheduler.py
and the bench_scheduler_*.py modules it calls):
the simulator's error against the served stack's own repeat spread, per load, and the p95 check at 0.8x
the SLA edge. The served runs themselves run in `make demo` (they need the stack)."""
from __future__ import annotations

import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.loadtest.bench_scheduler import summary
from scheduler.loadtest.bench_scheduler_config import BenchSchedulerConfig
from scheduler.loadtest.bench_scheduler_validation import VALIDATED, noise_check, sla_check
from scheduler.loadtest.bench_scheduler_report import _real_tables


def _val(share: float, measured: float, simulated: float, stack: int = 0) -> dict:
    return {"share_of_edge": share, "rate_rps": share * 4.0, "policy": "fixed-128", "stack": stack,
            "measured": {k: measured for k in VALIDATED}, "simulated": {k: simulated for k in VALIDATED},
            "rel_err": {k: abs(simulated - measured) / measured for k in VALIDATED}, "max_rel_err": 0.0}


def test_the_simulators_error_is_judged_against_the_served_runs_own_spread():
    # x0.5: two runs at 100 and 120 ms (spread 20 / 110), the simulator at 110 for both (errors 10/105, 10/115);
    # x0.8: two runs at 200 and 202 (spread 2 / 201), the simulator at 300 (errors 100/250, 98/251)
    runs = [_val(0.5, 100.0, 110.0), _val(0.8, 200.0, 300.0), _val(0.5, 120.0, 110.0), _val(0.8, 202.0, 300.0)]
    out = noise_check(runs)
    lo, hi = out["levels"]
    assert (lo["share_of_edge"], lo["runs"], hi["share_of_edge"]) == (0.5, 2, 0.8)
    assert lo["served_spread"]["ttft_p50_ms"] == pytest.approx(20 / 110)
    assert lo["sim_error"]["ttft_p50_ms"] == pytest.approx((10 / 105 + 10 / 115) / 2)
    assert lo["max_ratio"] < 1.0  # as close to each run as the runs are to each other
    assert hi["ratio"]["tpot_p95_ms"] == pytest.approx(((100 / 250 + 98 / 251) / 2) / (2 / 201))
    assert out["max_ratio"] == pytest.approx(hi["max_ratio"]) and out["max_ratio"] > 1.5  # a far simulator fails


def test_the_spread_is_read_across_stack_starts_where_runs_span_them():
    """Three runs at one load: two on the first stack (100 and 101 ms: 1% apart) and one on a stack of its own
    (120 ms). The simulator, fitted on another start, at 110: judged against the runs on different starts (pairs
    100/120 and 101/120), and against the one-stack pair beside it, which no model fitted elsewhere could meet."""
    runs = [_val(0.8, 100.0, 110.0, 0), _val(0.8, 101.0, 110.0, 0), _val(0.8, 120.0, 110.0, 1)]
    out = noise_check(runs)
    lv = out["levels"][0]
    across = float(np.median([20 / 110, 19 / 110.5]))
    assert lv["starts"] == 2 and out["spread"] == "across starts"
    assert lv["served_spread"]["ttft_p50_ms"] == pytest.approx(across)
    assert lv["served_spread_across_starts"]["ttft_p50_ms"] == pytest.approx(across)
    assert lv["served_spread_one_stack"]["ttft_p50_ms"] == pytest.approx(1 / 100.5)
    err = float(np.median([10 / 105, 9 / 105.5, 10 / 115]))
    assert lv["ratio"]["ttft_p50_ms"] == pytest.approx(err / across) and out["max_ratio"] < 1.5
    assert out["max_ratio_one_stack"] == pytest.approx(err / (1 / 100.5)) and out["max_ratio_one_stack"] > 1.5
    # one stack only: the one-stack spread is the spread, as before
    one = noise_check([_val(0.8, 100.0, 110.0), _val(0.8, 101.0, 110.0)])
    assert one["spread"] == "one stack" and one["levels"][0]["served_spread_across_starts"] is None
    assert one["max_ratio"] == pytest.approx(one["max_ratio_one_stack"])


def test_without_a_repeat_or_with_a_zero_spread_there_is_no_ratio():
    assert noise_check([]) is None
    one = noise_check([_val(0.5, 100.0, 110.0)])
    assert one["levels"][0]["ratio"]["ttft_p50_ms"] is None and one["max_ratio"] is None
    same = noise_check([_val(0.5, 100.0, 110.0), _val(0.5, 100.0, 110.0)])
    assert same["max_ratio"] is None  # identical runs: any error is infinitely many spreads, not a number


def _summary(ttft_p95: float, tpot_p95: float, errors: int = 0) -> dict:
    return {"ttft_p95_ms": ttft_p95, "tpot_p95_ms": tpot_p95, "errors": errors, "sla_attainment": 1.0,
            "sla": {"ttft_ms": 500.0, "tpot_ms": 50.0}}


def test_the_sla_check_needs_every_run_within_the_sla():
    ok = sla_check([_summary(400.0, 40.0), _summary(480.0, 49.0)], 0.8, "fixed-128")
    assert ok["held"] and [r["ttft_p95_ms"] for r in ok["runs"]] == [400.0, 480.0]
    assert not sla_check([_summary(400.0, 40.0), _summary(510.0, 40.0)], 0.8, "fixed-128")["held"]
    assert not sla_check([_summary(400.0, 51.0)], 0.8, "fixed-128")["held"]
    assert not sla_check([_summary(400.0, 40.0, errors=1)], 0.8, "fixed-128")["held"]  # a refusal is a miss
    assert sla_check([], 0.8, "fixed-128") is None


def test_the_check_load_must_be_served():
    with pytest.raises(ConfigError, match="sla_check_share 0.8 must be one of the validation_loads"):
        BenchSchedulerConfig(validation_loads=[0.5, 0.6])
    with pytest.raises(ConfigError, match="validation_fresh_stacks"):  # at least one repeat on the edge's stack
        BenchSchedulerConfig(validation_repeats=2, validation_fresh_stacks=2)
    assert BenchSchedulerConfig().sla_check_share in BenchSchedulerConfig().validation_loads


def test_the_summary_and_the_report_carry_both_checks():
    runs = [_val(0.5, 100.0, 110.0), _val(0.8, 200.0, 300.0), _val(0.5, 120.0, 110.0), _val(0.8, 202.0, 300.0)]
    served = {"sla_attainment": 1.0, "goodput_rps": 2.0, "requests": 10, "errors": 0, "ttft_p50_ms": 1.0,
              "ttft_p95_ms": 2.0, "tpot_p50_ms": 1.0, "tpot_p95_ms": 2.0}
    real = {"workload": "poisson-s1001", "load": 1.0, "rate_rps": 4.0, "best_fixed": "fixed-128",
            "goodput_ratio": 1.0, "goodput_ceiling": 1 / 0.96, "runs": {"fixed-128": served, "ppo": served},
            "validation": {},
            "validation_below_edge": runs, "repeat_spread": None, "noise_check": noise_check(runs),
            "sla_check": sla_check([_summary(400.0, 40.0), _summary(520.0, 40.0)], 0.8, "fixed-128"),
            "serving_path": {"engine_slowdown": 1.1, "prefill_slowdown": None, "serve_chunk_ms": 0.1,
                             "serve_chunk_sq_ms": 0.0, "ttft_overhead_ms": 5.0, "token_overhead_ms": 0.5}}
    report = {"sim": {"goodput_ratio_vs_best_fixed": {}, "goodput_ratio_vs_best_fixed_min": None, "at_sla_edge": {},
                      "sla_capacity": {}}, "capacity_rps": 4.0, "capacities_rps": {}, "real": real}
    s = summary(report, {}, "poisson")
    assert s["sim_error_vs_repeat_spread_max"] == pytest.approx(real["noise_check"]["max_ratio"])
    assert s["p95_within_sla_at_0_8_edge"] is False
    md = "\n".join(_real_tables(real, {"sla_ttft_ms": 500.0, "sla_tpot_ms": 50.0}))
    spread, err = 2 / 201, (100 / 250 + 98 / 251) / 2
    assert f"| x0.8 | tpot_p95_ms | n/a | {spread:.3f} | {err:.3f} | {err / spread:.2f} | {err / spread:.2f} |" in md
    assert "TTFT 520.0 ms" in md and "held in every run: no" in md
    # the most any policy could reach there: the best fixed budget met 96% of requests
    assert s["goodput_ceiling_vs_best_fixed_at_sla_edge"] == pytest.approx(1.0417, abs=1e-4)
    assert "The most any policy could reach on this schedule: 1.042" in md


def test_the_goodput_ceiling_is_every_request_within_the_sla():
    from scheduler.loadtest.bench_scheduler_overload import goodput_ceiling

    assert goodput_ceiling({"sla_attainment": 0.95}) == pytest.approx(1 / 0.95)
    assert goodput_ceiling({"sla_attainment": 1.0}) == 1.0 and goodput_ceiling({"sla_attainment": 0.0}) is None


def test_shedding_is_one_rule_for_every_policy():
    from scheduler.loadtest.bench_scheduler import env_config

    with pytest.raises(ConfigError, match="shed_late must be true, false or null"):
        BenchSchedulerConfig(shed_late="yes")
    info = {"env": {"sim": {"sla_ttft_ms": 500.0, "sla_tpot_ms": 50.0}}}
    on = env_config(BenchSchedulerConfig(run_dir="/nonexistent", shed_late=True), info)
    assert on.sim.shed_late is True  # the simulator grid, the replays and both served stacks read env.sim
    assert env_config(BenchSchedulerConfig(run_dir="/nonexistent"), info).sim.shed_late is False  # as trained


def _cell(goodput: float, std: float = 0.0) -> dict:
    return {"goodput_rps": goodput, "goodput_std": std}


def test_the_exit_depth_ablation_is_the_goodput_ratio_per_cell_without_collapsed_ones():
    from scheduler.loadtest.bench_scheduler_ablation import ablation_report
    from scheduler.loadtest.bench_scheduler_config import ABLATED, LEARNED

    cells = {("poisson", 0.5, LEARNED): _cell(2.0, 0.1), ("poisson", 0.5, ABLATED): _cell(1.6),
             ("poisson", 1.0, LEARNED): _cell(3.0), ("poisson", 1.0, ABLATED): _cell(3.0, 0.3),
             ("poisson", 2.0, LEARNED): _cell(0.5), ("poisson", 2.0, ABLATED): _cell(0.1),
             ("bursty", 0.5, LEARNED): _cell(1.0), ("bursty", 0.5, ABLATED): _cell(0.0)}
    r = ablation_report(cells, ["poisson", "bursty"], [0.5, 1.0, 2.0], collapsed={("poisson", 2.0)})
    assert r["ratios"] == {"poisson": {"0.5": pytest.approx(1.25), "1": pytest.approx(1.0)}}
    assert r["median"] == pytest.approx(1.125) and r["min"] == pytest.approx(1.0)
    assert r["seed_spread_rel_max"] == pytest.approx(0.1)
    assert ablation_report(cells, ["bursty"], [0.5]) is None  # no cell with both goodputs
    s = summary({"sim": {"goodput_ratio_vs_best_fixed": {}, "goodput_ratio_vs_best_fixed_min": None,
                         "at_sla_edge": {}, "sla_capacity": {}, "exit_features_ablation": r},
                 "capacity_rps": 4.0, "capacities_rps": {}}, {}, "poisson")
    assert s["goodput_ratio_exit_features_ablation"] == pytest.approx(1.125)


def test_the_ablation_policy_must_lack_the_exit_features_and_share_the_sla(tmp_path):
    from scheduler.control.env import EXIT_FEATURES
    from scheduler.control.learned import LearnedPolicy, save_artifact
    from scheduler.loadtest.bench_scheduler_ablation import load_ablation
    from tests.unit.scheduler.control.test_learned import tiny_model

    sim = {"sla_ttft_ms": 500.0, "sla_tpot_ms": 50.0}
    shipped = LearnedPolicy.load(save_artifact(tiny_model(), tmp_path / "ppo", {"env": {"sim": sim}}))
    seeing = save_artifact(tiny_model(), tmp_path / "seeing", {"env": {"sim": sim}})
    other_sla = save_artifact(tiny_model(), tmp_path / "other", {"env": {"sim": {**sim, "sla_ttft_ms": 1000.0},
                                                                        "masked": list(EXIT_FEATURES)}})
    good = save_artifact(tiny_model(), tmp_path / "good", {"env": {"sim": sim, "masked": list(EXIT_FEATURES)}})
    assert load_ablation(BenchSchedulerConfig(ablation_policy=""), shipped) is None
    assert load_ablation(BenchSchedulerConfig(ablation_policy=str(good)), shipped).masked == EXIT_FEATURES
    with pytest.raises(ConfigError, match="sees the exit-depth features"):
        load_ablation(BenchSchedulerConfig(ablation_policy=str(seeing)), shipped)
    with pytest.raises(ConfigError, match="sla_ttft_ms 1000.0"):
        load_ablation(BenchSchedulerConfig(ablation_policy=str(other_sla)), shipped)
    with pytest.raises(ConfigError, match="missing"):
        load_ablation(BenchSchedulerConfig(ablation_policy=str(tmp_path / "absent")), shipped)


def _run(goodput: float, attainment: float, requests: int = 100, errors: int = 0) -> dict:
    return {"requests": requests, "errors": errors, "sla_attainment": attainment, "goodput_rps": goodput,
            "ttft_p50_ms": 500.0, "ttft_p95_ms": 600.0, "tpot_p50_ms": 6.0, "tpot_p95_ms": 20.0}


def test_every_repeat_past_the_edge_runs_every_policy_in_a_rotated_order():
    from scheduler.loadtest.bench_scheduler_overload import overload_plan

    plan = overload_plan(["ppo", "fixed-256", "aimd"], 3)
    assert plan == [(0, "ppo"), (0, "fixed-256"), (0, "aimd"), (1, "fixed-256"), (1, "aimd"), (1, "ppo"),
                    (2, "aimd"), (2, "ppo"), (2, "fixed-256")]
    assert [p for r, p in plan if p == "ppo"] == ["ppo"] * 3  # once per repeat, first, last and in between


def test_past_the_edge_the_learned_policys_goodput_is_compared_within_each_repeat():
    """Ratios are taken run against run of one repeat, then their median: repeat 1 is a slow minute for both
    (ppo 4 against 2), repeat 2 a fast one (9 against 3); pooled medians (6 / 2.5) would read another number."""
    from scheduler.loadtest.bench_scheduler_overload import by_policy, overload_plan, overload_report

    plan = overload_plan(["ppo", "fixed-256", "aimd"], 3)
    got = {("ppo", 0): _run(6.0, 0.3), ("fixed-256", 0): _run(2.5, 0.1), ("aimd", 0): _run(3.0, 0.12),
           ("ppo", 1): _run(4.0, 0.2), ("fixed-256", 1): _run(2.0, 0.08), ("aimd", 1): _run(0.0, 0.0),
           ("ppo", 2): _run(9.0, 0.45), ("fixed-256", 2): _run(3.0, 0.125), ("aimd", 2): _run(4.5, 0.2)}
    runs = by_policy(plan, [got[(p, r)] for r, p in plan])
    assert [s["goodput_rps"] for s in runs["ppo"]] == [6.0, 4.0, 9.0]  # in repeat order, whatever the run order
    o = overload_report(runs, "ppo", "fixed-256", 2.0, 33.0, "the simulator at x2")
    fixed = o["ratio_vs"]["fixed-256"]
    assert fixed["per_repeat"] == pytest.approx([2.4, 2.0, 3.0]) and fixed["median"] == pytest.approx(2.4)
    assert (fixed["min"], fixed["max"]) == (pytest.approx(2.0), pytest.approx(3.0))
    # a repeat where AIMD met nothing has no ratio (not infinity); the median is over the others
    assert o["ratio_vs"]["aimd"]["per_repeat"][1] is None and o["ratio_vs"]["aimd"]["median"] == pytest.approx(2.0)
    assert o["ceiling_vs_best_fixed"]["median"] == pytest.approx(10.0)  # 1 / 0.1: every request within the SLA
    assert o["goodput_rps"]["ppo"]["median"] == 6.0 and o["repeats"] == 3 and "ppo" not in o["ratio_vs"]


def test_the_summary_and_both_reports_carry_the_runs_past_the_edge():
    from edge.pipeline.report_serving_md import scheduler_md
    from scheduler.loadtest.bench_scheduler_overload import by_policy, overload_plan, overload_report
    from scheduler.loadtest.bench_scheduler_report import _overload_table

    plan = overload_plan(["ppo", "fixed-256", "aimd"], 3)
    runs = by_policy(plan, [_run({"ppo": 6.0, "fixed-256": 2.0, "aimd": 3.0}[p] + r, 0.2) for r, p in plan])
    over = overload_report(runs, "ppo", "fixed-256", 2.0, 33.0, "the simulator at x2")
    served = {"sla_attainment": 1.0, "goodput_rps": 2.0, "requests": 10, "errors": 0}
    real = {"goodput_ratio": 1.0, "goodput_ceiling": 1.0, "runs": {"fixed-128": served, "ppo": served},
            "validation": {}, "validation_below_edge": [], "overload": over}
    report = {"sim": {"goodput_ratio_vs_best_fixed": {"poisson": 1.0}, "goodput_ratio_vs_best_fixed_min": 1.0,
                      "at_sla_edge": {}, "sla_capacity": {}}, "capacity_rps": 4.0, "capacities_rps": {}, "real": real}
    s = summary(report, {}, "poisson")
    assert s["overload_factor"] == 2.0 and s["overload_repeats"] == 3
    assert s["goodput_ratio_vs_best_fixed_overload"] == pytest.approx(7.0 / 3.0)  # 6/2, 7/3, 8/4 within repeats
    assert s["goodput_ratio_vs_best_fixed_overload_range"] == [pytest.approx(2.0), pytest.approx(3.0)]
    assert s["goodput_ratio_vs_aimd_overload"] == pytest.approx(7.0 / 4.0)
    md = "\n".join(_overload_table(over))
    assert "x2 of it, 33.00 req/s" in md and "| ppo | 0.200 (0.200-0.200) | 7.00 (6.00-8.00) |" in md
    assert "/ fixed-256 2.333 (2.000-3.000)" in md and "/ aimd 1.750" in md
    line = next(x for x in scheduler_md({**s, "sla_attainment": {}}) if x.startswith("Past the edge"))
    assert "best fixed budget 2.33 (range 2.00-3.00), / AIMD 1.75" in line


def test_the_runs_past_the_edge_are_checked_before_anything_runs():
    with pytest.raises(ConfigError, match="overload is a multiple of the edge's rate above 1"):
        BenchSchedulerConfig(overload=0.8)
    with pytest.raises(ConfigError, match="overload_repeats must be >= 0"):
        BenchSchedulerConfig(overload_repeats=-1)
    assert BenchSchedulerConfig(overload_repeats=0).overload == 2.0  # the simulator's comparison, no served runs
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        BenchSchedulerConfig(overload_heuristics=["nope"])
    assert BenchSchedulerConfig(overload=None).overload is None


def test_a_policy_that_is_one_constant_action_never_beats_the_best_constant_action():
    """The learned policy is judged against every constant action of its own grid too: a stand-in 'learned' policy
    that is one of them (512 tokens, 4 sequences) can at best tie the best (ratio <= 1, exactly: the simulator is
    deterministic for a given draw), and the best is named so that the real stack can serve it."""
    import math

    from scheduler.control.env import ACTIONS, EnvConfig
    from scheduler.control.evaluate import WorkloadSpec
    from scheduler.control.exit_model import ExitModel
    from scheduler.control.latency import FEATURES, LatencyModel
    from scheduler.control.policies import FixedBudget
    from scheduler.loadtest.bench_scheduler_overload import CONSTANT_PREFIX, constant_actions, constant_kwargs, constant_name

    lm = LatencyModel({f: 0.0 for f in FEATURES} | {"one": 1e-3, "decode_rows": 0.3e-3, "prefill_tokens": 0.15e-3},
                      12, [3, 9, 12])
    env = EnvConfig(capacity_rps=20.0)
    out = constant_actions(lm, ExitModel([3, 9, 12], [0.1, 0.2, 0.7]), env, WorkloadSpec("p", "poisson", 3),
                           [1.0, 2.0], 20.0, 10.0, [0], FixedBudget(512, 4))
    assert list(out) == ["x1", "x2"]
    for c in out.values():
        assert c["best"].startswith(CONSTANT_PREFIX) and not math.isnan(c["goodput_rps"])
        assert c["ratio"] <= 1.0 + 1e-12
        kw = constant_kwargs(c["best"])
        assert (kw["prefill_budget"], kw["max_running"]) in ACTIONS
        assert c["best_all_slots"].startswith("fixed-")  # the best fixed budget there, for a load off the grid
    assert constant_kwargs(constant_name(256, 8)) == {"prefill_budget": 256, "max_running": 8}
    # the constant actions with the widest limit are the grid's fixed budgets (FixedBudget's default admission limit)
    from edge.runtime.settings import MAX_RUNNING
    assert max(m for _, m in ACTIONS) == MAX_RUNNING.default


def test_the_best_constant_action_past_the_edge_is_reported_by_role_not_by_name():
    from scheduler.loadtest.bench_scheduler_overload import by_policy, overload_plan, overload_report

    plan = overload_plan(["ppo", "fixed-512", "const-512x4"], 3)
    runs = by_policy(plan, [_run({"ppo": 6.0, "fixed-512": 2.0, "const-512x4": 6.0}[p] + r, 0.2) for r, p in plan])
    over = overload_report(runs, "ppo", "fixed-512", 2.0, 33.0, "the simulator at x2", "const-512x4")
    consts = {"x1": {"load": 1.0, "ratio": 0.98}, "x2": {"load": 2.0, "ratio": 0.95}}
    real = {"goodput_ratio": 1.0, "goodput_ceiling": 1.0, "runs": {}, "validation": {}, "validation_below_edge": [],
            "overload": over, "constant_actions_sim": consts}
    report = {"sim": {"goodput_ratio_vs_best_fixed": {}, "goodput_ratio_vs_best_fixed_min": None, "at_sla_edge": {},
                      "sla_capacity": {}}, "capacity_rps": 4.0, "capacities_rps": {}, "real": real}
    s = summary(report, {}, "poisson")
    assert s["goodput_ratio_vs_best_constant_overload"] == pytest.approx(1.0)
    assert s["goodput_ratio_vs_best_fixed_overload"] == pytest.approx(7.0 / 3.0)
    assert s["best_constant_overload"] == "const-512x4" and "goodput_ratio_vs_const-512x4_overload" not in s
    assert (s["goodput_ratio_vs_best_constant_sim_at_sla_edge"], s["goodput_ratio_vs_best_constant_sim_overload"]) \
        == (0.98, 0.95)
    # where the best constant action is the best fixed budget's own action, both ratios read the same runs
    same = overload_report({k: v for k, v in runs.items() if k != "const-512x4"}, "ppo", "fixed-512", 2.0, 33.0,
                           "the simulator at x2", "fixed-512")
    s2 = summary({**report, "real": {**real, "overload": same}}, {}, "poisson")
    assert s2["goodput_ratio_vs_best_constant_overload"] == s2["goodput_ratio_vs_best_fixed_overload"]
