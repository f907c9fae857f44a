"""The serving path's fit recovers what it measures: results made by the simulator with a known
slowdown and overheads give those numbers back; too few results are refused."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.control.latency import FEATURES, LatencyModel
from scheduler.control.policies import FixedBudget
from scheduler.loadtest.profile_report import render_serving
from scheduler.control.engine_model import ServingPath
from scheduler.loadtest.serving_fit import fit_serving_path, latency_stats, replay_pool
from scheduler.loadtest.serving_steps import fit_steps, read_step_log
from scheduler.control.exit_model import ExitModel
from scheduler.control.sim import simulate
from scheduler.control.sim_config import SimConfig
from scheduler.control.workload import Arrivals, Workload, synthetic

LM = LatencyModel({f: 0.0 for f in FEATURES} | {"one": 1e-3, "decode_rows": 0.4e-3, "prefill_tokens": 0.2e-3,
                                                 "prefill_calls": 1e-3}, 12, [3, 9, 12])
EX = ExitModel([3, 9, 12], [0, 0, 1])


def _results(w: Workload, budget: int = 128, **cfg):
    return simulate(LM, EX, SimConfig(**cfg), w, FixedBudget(budget, 16)).results()


def _steps(truth: dict, n: int = 400, seed: int = 0) -> list[dict]:
    """Step-log records of random decode batches and prefill chunks, timed as ``truth`` says (+-5% noise)."""
    from scheduler.loadtest.serving_steps import step_terms

    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n):
        rows = [(int(rng.integers(10, 300)), int(rng.choice([3, 9, 12]))) for _ in range(int(rng.integers(0, 13)))]
        pre = [(0, int(rng.integers(16, 129)))] if rng.random() < 0.4 or not rows else []
        steps.append({"s": 0.0, "c": len(rows) + len(pre), "d": rows, "p": pre, "a": int(rng.integers(0, 9))})
    T = step_terms(LM, steps)
    y = T[:, :6] @ np.array([truth["engine_slowdown"], truth["prefill_slowdown"], truth["serve_chunk_ms"],
                             truth.get("serve_chunk_sq_ms", 0.0), truth.get("front_decode_per_arrival", 0.0),
                             truth.get("front_prefill_per_arrival", 0.0)])
    for st, v in zip(steps, y * rng.uniform(0.95, 1.05, n)):
        st["s"] = float(v)
    return steps


def test_the_served_steps_give_the_slowdowns_and_the_chunk_cost():
    truth = dict(engine_slowdown=1.2, prefill_slowdown=0.9, serve_chunk_ms=1.5, serve_chunk_sq_ms=0.1,
                 front_decode_per_arrival=0.25, front_prefill_per_arrival=0.1)
    fields, fit = fit_steps(LM, _steps(truth, n=4000))  # six terms, two of them near-collinear (rows, chunks)
    assert fields["engine_slowdown"] == pytest.approx(1.2, rel=0.1)
    assert fields["prefill_slowdown"] == pytest.approx(0.9, rel=0.05)
    # the front end's work per recent arrival, on top of each part's factor
    assert fields["front_decode_per_arrival"] == pytest.approx(0.25, rel=0.1)
    assert fields["front_prefill_per_arrival"] == pytest.approx(0.1, rel=0.15)
    assert set(fit["decode_by_recent_arrivals"]) == {"0-2", "3-5", "6-9"}
    assert fields["serve_chunk_ms"] == pytest.approx(1.5, rel=0.2)
    assert fields["serve_chunk_sq_ms"] == pytest.approx(0.1, rel=0.3)
    assert fit["rel_err_median"] < 0.05 and fit["steps"] == 4000 and fit["total_ratio"] == pytest.approx(1.0, abs=0.01)
    assert set(fit["decode_batches"]) == {"1-1", "2-3", "4-7", "8+"}
    with pytest.raises(ConfigError, match="busy steps"):
        fit_steps(LM, _steps(truth, n=10))


def test_the_fit_is_the_same_with_its_replays_in_other_processes():
    """``replay_pool``: the replays run in spawned processes, interleaved over them; every replay is seeded, so
    the fit (every evaluation of the loss, so the optimiser's path and its end) is the one computed in process."""
    truth = dict(ttft_overhead_ms=20.0, token_overhead_ms=3.0, ingress_ms=8.0)
    runs = [_results(synthetic(int(rate * 6), rate, Arrivals.POISSON, seed=5 + i, prompt_mean=120, output_mean=24),
                     budget, **truth) for i, (rate, budget) in enumerate(((6.0, 128), (14.0, 64), (9.0, 128)))]
    steps = _steps(dict(engine_slowdown=1.2, prefill_slowdown=1.0, serve_chunk_ms=0.3), n=600)
    here = fit_serving_path(LM, EX, SimConfig(), runs, [128, 64, 128], steps, seeds=(0, 1, 2), max_evals=12)
    with replay_pool(2) as pool:
        there = fit_serving_path(LM, EX, SimConfig(), runs, [128, 64, 128], steps, seeds=(0, 1, 2), max_evals=12,
                                 pool=pool)
    assert pool is not None and there == here and here.fit["evaluations"] >= 12
    with replay_pool(1) as none:
        assert none is None  # one core: the replays run in process


def test_fit_recovers_the_serving_path(tmp_path):
    """Two calibration runs made by the simulator with known fields, and a step log timed by them:
    the fit gives percentiles that match the runs (its own table) and the fields back."""
    truth = dict(ttft_overhead_ms=20.0, token_overhead_ms=3.0, engine_slowdown=1.6, prefill_slowdown=1.2,
                 serve_chunk_ms=0.3, ingress_ms=8.0, front_decode_per_arrival=0.02, front_prefill_per_arrival=0.01)
    runs = [_results(synthetic(int(rate * 12), rate, Arrivals.POISSON, seed=3 + i, prompt_mean=120, output_mean=24),
                     budget, **truth) for i, (rate, budget) in enumerate(((6.0, 128), (14.0, 64)))]
    sp = fit_serving_path(LM, EX, SimConfig(), runs, [128, 64], _steps(truth, n=4000), seeds=(0,))
    used = sum(r.ok and r.tokens >= 2 for run in runs for r in run)
    assert sp.fit["max_rel_err"] < 0.05 and [r["budget"] for r in sp.fit["runs"]] == [128, 64] and sp.requests == used
    assert sp.engine_slowdown == pytest.approx(1.6, rel=0.05)
    assert sp.prefill_slowdown == pytest.approx(1.2, rel=0.05)
    assert sp.front_decode_per_arrival == pytest.approx(0.02, rel=0.2)
    # the front end's 8 ms per request and the 20 ms first-token overhead: at these loads (front-end
    # utilisation <= 11%) its queue adds under a millisecond, so the runs fix their sum, not the split
    assert sp.ttft_overhead_ms + sp.ingress_ms == pytest.approx(28.0, abs=3.0)
    assert SimConfig(**sp.sim_fields())  # the fields are the simulator's
    md = render_serving(asdict(sp))  # profile.md's section: one row per decode batch and per run x metric
    assert sum(r.startswith("| ") and "req/s" in r for r in md) == 2 * 4
    assert sum(r.startswith(f"| {b} |") for r in md for b in sp.fit["steps"]["decode_batches"]) == \
        len(sp.fit["steps"]["decode_batches"]) > 0
    sp.save(tmp_path / "serving.json")
    assert ServingPath.load(tmp_path / "serving.json") == sp and ServingPath.load(tmp_path / "none.json") is None


def test_a_run_past_the_sla_is_replayed_not_fitted():
    """Three runs of one stack, the third at a rate the stack did not hold within the SLA at p95 (past its knee,
    where two runs of one schedule differ by 2x): its simulated percentiles are reported and it does not move the
    fit, which recovers the overheads from the other two as it would without it. If every run is past the SLA,
    all are fitted (nothing else to fit)."""
    truth = dict(ttft_overhead_ms=20.0, token_overhead_ms=3.0, engine_slowdown=1.6, prefill_slowdown=1.2,
                 serve_chunk_ms=0.3, ingress_ms=8.0)
    steps = _steps(truth, n=4000)
    light = [_results(synthetic(int(rate * 12), rate, Arrivals.POISSON, seed=3 + i, prompt_mean=120, output_mean=24),
                      budget, **truth) for i, (rate, budget) in enumerate(((6.0, 128), (14.0, 64)))]
    # past the knee: a stack far slower than the others' (its latencies from ten times the overheads)
    heavy = _results(synthetic(int(40 * 12), 40.0, Arrivals.POISSON, seed=9, prompt_mean=120, output_mean=24), 128,
                     **{**truth, "ttft_overhead_ms": 600.0, "token_overhead_ms": 60.0})
    cfg = SimConfig(sla_ttft_ms=500.0, sla_tpot_ms=50.0)
    sp = fit_serving_path(LM, EX, cfg, light + [heavy], [128, 64, 128], steps, seeds=(0,))
    assert [r["fitted"] for r in sp.fit["runs"]] == [True, True, False] and not sp.fit["runs"][2]["held_sla"]
    assert sp.fit["runs"][2]["max_rel_err"] > 0.5 and sp.fit["max_rel_err"] < 0.05  # the fitted runs' largest
    alone = fit_serving_path(LM, EX, cfg, light, [128, 64], steps, seeds=(0,))  # the same loss: the same fields
    assert sp.sim_fields() == alone.sim_fields()
    assert sum("not fitted" in r for r in render_serving(asdict(sp))) == 4  # its four metric rows say so
    everything_late = SimConfig(sla_ttft_ms=1.0, sla_tpot_ms=0.1)
    sp = fit_serving_path(LM, EX, everything_late, light, [128, 64], steps, seeds=(0,), max_evals=20)
    assert [r["fitted"] for r in sp.fit["runs"]] == [True, True]


def test_the_step_log_is_read_and_a_broken_line_is_named(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text('{"s":0.01,"e":0.001,"c":2,"d":[[40,3],[12,12]],"p":[]}\n{"s":0.02,"e":0,"c":1,"d":[],"p":[[0,64]]}\n'
                   '{"s":0.0')  # the last line cut by a stopped stack
    steps = read_step_log(log)
    assert len(steps) == 2 and steps[0]["s"] == pytest.approx(0.011) and steps[1]["p"] == [(0, 64)]
    assert steps[0]["a"] == 0 and steps[0]["n"] == 0  # a log written before the arrivals were logged
    log.write_text('{"s":0.01,"e":0,"c":1,"d":[[40,3]],"p":[],"n":5,"a":3}\n')
    assert read_step_log(log)[0]["a"] == 3 and read_step_log(log)[0]["n"] == 5
    log.write_text('{"s":0.01,"c":2}\n{"s":0.02,"e":0,"c":1,"d":[],"p":[]}\n')
    with pytest.raises(ConfigError, match="line 1"):
        read_step_log(log)
    with pytest.raises(ConfigError, match="no step log"):
        read_step_log(tmp_path / "none.jsonl")


def test_a_serving_json_of_the_one_factor_fit_still_loads(tmp_path):
    """serving.json written before prefill_slowdown existed: prefill is slowed as decode."""
    (tmp_path / "serving.json").write_text('{"ttft_overhead_ms": 29.6, "token_overhead_ms": 3.8, '
                                           '"serve_chunk_ms": 0.0, "engine_slowdown": 1.8, "probes": 8}')
    sp = ServingPath.load(tmp_path / "serving.json")
    assert sp.prefill_slowdown is None and sp.engine_slowdown == 1.8
    sim = simulate(LM, EX, SimConfig(**sp.sim_fields()), Workload(np.zeros(1), np.array([100]), np.array([1]), "one"),
                   FixedBudget(128, 16))
    assert sim.step_seconds_total == pytest.approx(1.8 * (1e-3 + 1e-3 + 100 * 0.2e-3))


def test_too_few_results_are_refused():
    with pytest.raises(ConfigError, match="need 8 in each"):
        fit_serving_path(LM, EX, SimConfig(), [[]], 128, [])
    with pytest.raises(ConfigError, match="2 budgets for 1 runs"):
        fit_serving_path(LM, EX, SimConfig(), [_results(Workload(np.arange(10.0), np.full(10, 50), np.full(10, 8), "w"))],
                         [128, 64], [])


def test_the_served_draft_rounds_are_counted_by_batch_size(tmp_path):
    """The step log's ``k`` (per decoding sequence: tokens emitted, 1 where they came from a draft round) gives, per
    decode batch bucket, the share of sequences that took a plain step and that verified a round of 1, 2, ...
    tokens; a log written before ``k`` counts a plain step per row. The rounds' own cost is a step term."""
    from scheduler.loadtest.serving_steps import decode_rounds, step_terms

    log = tmp_path / "steps.jsonl"
    log.write_text('{"s":0.01,"e":0,"c":1,"d":[],"k":[[3,1]],"p":[]}\n'
                   '{"s":0.01,"e":0,"c":1,"d":[[41,3]],"k":[[1,0]],"p":[]}\n'
                   '{"s":0.01,"e":0,"c":2,"d":[[40,12]],"k":[[1,0],[2,1]],"p":[]}\n'
                   '{"s":0.02,"e":0,"c":1,"d":[],"p":[[0,64]]}\n'
                   '{"s":0.01,"e":0,"c":3,"d":[[9,3],[9,12],[9,12]],"p":[]}\n')  # before k: a plain step per row
    steps = read_step_log(log)
    assert [st["k"] for st in steps] == [[(3, 1)], [(1, 0)], [(1, 0), (2, 1)], [], [(1, 0)] * 3]
    assert decode_rounds(steps) == {"1": [0.5, 0.0, 0.0, 0.5], "2": [0.5, 0.0, 0.5], "3-4": [1.0]}
    assert decode_rounds(steps[3:4]) is None
    T = step_terms(LM, steps)  # rounds, in ms, in the column of the step's decode batch: "1", then "2"
    assert T[0, 6] == T[2, 7] == 1e-3 and T[:, 6:].sum() == pytest.approx(2e-3)


def test_the_step_fit_prices_the_draft_rounds():
    """Steps that verify rounds (calls outside the batched step) cost a price per round that depends on the decode
    batch (0.8 ms at batch 1, 0.5 ms in batches of 3-4 here): the fit recovers both beside the slowdowns, the
    chunk cost does not absorb them, steps that only verified rounds count (they have no profiled part), and
    round_ms is the rounds' mean price."""
    rng = np.random.default_rng(3)
    steps = _steps({"engine_slowdown": 1.2, "prefill_slowdown": 1.0, "serve_chunk_ms": 0.3}, n=600)
    price = {1: 0.8e-3, 3: 0.5e-3, 4: 0.5e-3}
    n_rounds = {1: 0, 3: 0, 4: 0}
    for st in steps:
        rows = len(st["d"])
        b = int(rng.choice([1, 3, 4]))
        if rows > b or st["p"]:
            st["k"] = [(1, 0)] * rows
            continue
        n = b - rows  # the other sequences of a batch of b verified rounds instead
        st["k"] = [(1, 0)] * rows + [(int(rng.integers(1, 5)), 1) for _ in range(n)]
        st["c"] += n
        st["s"] += n * (price[b] + 0.3e-3)
        n_rounds[b] += n
    for _ in range(100):  # steps where every sequence verified a round: no profiled part, engine time all the same
        b = int(rng.choice([1, 3, 4]))
        steps.append({"s": b * (price[b] + 0.3e-3), "c": b, "d": [], "p": [], "a": 0, "k": [(2, 1)] * b})
        n_rounds[b] += b
    only_rounds = sum(not st["d"] and not st["p"] and bool(st["k"]) for st in steps)
    fields, fit = fit_steps(LM, steps)
    assert only_rounds > 20 and fit["steps"] == sum(bool(st["d"] or st["p"] or st["k"]) for st in steps)
    assert fields["round_ms_by_batch"]["1"] == pytest.approx(0.8, rel=0.1)
    assert fields["round_ms_by_batch"]["3-4"] == pytest.approx(0.5, rel=0.1)
    assert set(fields["round_ms_by_batch"]) == {"1", "3-4"}  # no rounds measured at 2, 5-8, 9+: no price there
    mean = (0.8 * n_rounds[1] + 0.5 * (n_rounds[3] + n_rounds[4])) / sum(n_rounds.values())
    assert fields["round_ms"] == pytest.approx(mean, rel=0.1)
    assert fields["serve_chunk_ms"] == pytest.approx(0.3, rel=0.1)
    assert fields["engine_slowdown"] == pytest.approx(1.2, rel=0.05)


def test_the_step_log_is_read_within_the_runs_kept(tmp_path):
    """A log that also holds a warm-up's (or other runs') steps: only the lines of the ranges kept are read,
    [start, end) by 0-based line number, and count_lines counts what a range is made of."""
    from scheduler.loadtest.serving_steps import count_lines

    log = tmp_path / "steps.jsonl"
    assert count_lines(log) == 0
    log.write_text("".join(f'{{"s":0.0{i},"e":0,"c":1,"d":[[40,12]],"p":[]}}\n' for i in range(1, 7)))
    assert count_lines(log) == 6
    assert [st["s"] for st in read_step_log(log, [(1, 3), (5, 6)])] == pytest.approx([0.02, 0.03, 0.06])
    assert len(read_step_log(log, [])) == 0 and len(read_step_log(log)) == 6


def test_where_the_log_names_the_requests_only_steps_far_from_their_end_are_counted(tmp_path):
    """With request ids (``i``, one per ``k`` entry) only the steps of a sequence with more than MAX_ROUND_TOKENS
    tokens still to go count in the shares: nearer its end the engine drafts less (a round stops at max_tokens),
    and the simulator cuts its own draws there. A log without ids counts every step, as before."""
    import json

    from scheduler.control.sim_config import MAX_ROUND_TOKENS
    from scheduler.loadtest.serving_steps import decode_rounds

    assert MAX_ROUND_TOKENS == 8
    lines = []
    for rid in range(3):  # alone, 23 tokens: a plain step, seven rounds of 3 (22 .. 4 to go), a round cut to 1
        lines.append({"s": 0.01, "e": 0, "c": 1, "d": [[40, 12]], "k": [[1, 0]], "i": [rid], "p": []})
        lines += [{"s": 0.01, "e": 0, "c": 1, "d": [], "k": [[3, 1]], "i": [rid], "p": []} for _ in range(7)]
        lines.append({"s": 0.01, "e": 0, "c": 1, "d": [], "k": [[1, 1]], "i": [rid], "p": []})
    lines.append({"s": 0.01, "e": 0, "c": 2, "d": [], "k": [[2, 1], [3, 1]], "i": [7, 8], "p": []})  # both short
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    steps = read_step_log(log)
    assert steps[0]["i"] == [0] and steps[-1]["i"] == [7, 8]
    # counted: the plain step (23 to go) and the rounds at 22, 19, 16, 13 and 10 to go; not those at 7, 4 and 1
    assert decode_rounds(steps) == {"1": pytest.approx([1 / 6, 0.0, 0.0, 5 / 6])}
    for x in lines:
        del x["i"]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    old = read_step_log(log)
    assert old[0]["i"] is None
    assert decode_rounds(old) == {"1": pytest.approx([1 / 9, 1 / 9, 0.0, 7 / 9]), "2": [0.0, 0.0, 0.5, 0.5]}


def test_the_calibration_runs_are_kept_for_a_refit(tmp_path):
    """save_runs / load_runs: the fit's inputs round-trip (a refit or a diagnosis needs no stack); a malformed
    file is a ConfigError."""
    from scheduler.loadtest.serving_runs import load_runs, save_runs

    runs = [_results(Workload(np.arange(10.0), np.full(10, 50), np.full(10, 8), "w")),
            _results(Workload(np.arange(4.0), np.full(4, 20), np.full(4, 3), "w"))]
    save_runs(tmp_path / "runs.json", runs, [128, 512], [{"share_of_edge": 0.8}, {"share_of_edge": 1.0}])
    back, budgets = load_runs(tmp_path / "runs.json")
    assert budgets == [128, 512] and [len(r) for r in back] == [10, 4]
    import json

    assert [r["share_of_edge"] for r in json.loads((tmp_path / "runs.json").read_text())["runs"]] == [0.8, 1.0]
    assert [latency_stats(r) for r in back] == [latency_stats(r) for r in runs]
    (tmp_path / "bad.json").write_text('{"runs": [{"requests": []}]}')
    with pytest.raises(ConfigError, match="calibration runs"):
        load_runs(tmp_path / "bad.json")


def test_runs_served_on_several_stacks_are_fitted_together():
    """merge_starts: the same runs served on two stacks give twice the runs, their budgets and a start label each;
    the second stack's request ids, which restart at 0, are told apart (so a request's steps stay its own)."""
    from scheduler.loadtest.serving_runs import merge_starts
    from scheduler.loadtest.serving_steps import decode_rounds

    w = Workload(np.arange(10.0), np.full(10, 50), np.full(10, 8), "w")
    first = [_results(w), _results(w)]
    rounds = [{"s": 0.01, "e": 0, "c": 1, "d": [], "k": [[3, 1]], "i": [0], "p": []}] * 4  # 12 tokens in rounds
    plain = [{"s": 0.01, "e": 0, "c": 1, "d": [[9, 12]], "k": [[1, 0]], "i": [0], "p": []}] * 12  # 12 plain steps
    runs, steps, budgets, labels = merge_starts([(first, rounds), (first, plain)], [512, 128])
    assert len(runs) == 4 and budgets == [512, 128, 512, 128]
    assert labels == [{"start": 0}, {"start": 0}, {"start": 1}, {"start": 1}]
    assert [st["i"] for st in steps] == [[0]] * 4 + [["1:0"]] * 12 and rounds[0]["i"] == [0]
    # two requests of 12 tokens: counted with more than 8 to go, the rounds at 12 and 9 and the plain steps at 12,
    # 11, 10 and 9 (one request of 24, had the ids not been told apart: 4 rounds and 4 plain steps)
    assert decode_rounds(steps) == {"1": pytest.approx([2 / 3, 0.0, 0.0, 1 / 3])}
    with pytest.raises(ConfigError, match="start 1 served 1 runs, 2 expected"):
        merge_starts([(first, []), (first[:1], [])], [512, 128])
