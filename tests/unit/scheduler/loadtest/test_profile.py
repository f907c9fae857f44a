"""``smartexit profile``'s bookkeeping (step features from engine states, checked against a tiny real
engine's own outputs), its scenarios and config, and the latency model's fit (scheduler/control/latency.py)."""
from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from edge.core.configio import apply
from edge.core.errors import ConfigError
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import NO_TOKEN, Request, TokenEvent
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from scheduler.control.latency import (FEATURES, FORMAT, LatencyModel, StepFeatures, combine, decode_features, fit_latency,
                               prefill_features)
from edge.pipeline.profile import main
from scheduler.loadtest.profile_config import ProfileConfig, Scenario, check_scenarios, generate_scenarios
from scheduler.loadtest.profile_driver import exits_allowed, run_profile, step_features, timed_step
from scheduler.loadtest.profile_fit import design, held_out_groups
from tests.unit.edge.runtime.test_engine import _model, _prompts

SEGMENTS = [2, 4, 6]  # the tiny test model's exits (tests/unit/edge/runtime/test_engine.py)


def _ev(rid: int, layer: int, token: int = 7, finished: bool = False) -> TokenEvent:
    return TokenEvent(rid, token, layer, 0, finished)


# --------------------------------------------------------------------------- step features


def test_step_features_split_decode_rows_from_prefill_first_tokens():
    # before: 1 and 2 decoding (contexts 10, 20); 3 prefilling at 5 of its prompt; 4 and 5 waiting.
    # In the step 3 completes its prompt (first token, full depth), 4 is admitted and prefilled 3 tokens,
    # 5 stays waiting; 2 is cancelled before its token (an event without one).
    events = [_ev(1, 2), _ev(2, NO_TOKEN, NO_TOKEN, True), _ev(3, 6)]
    obs = step_features({1: 10, 2: 20}, {3: 5, 4: 0, 5: 0}, {3: 9, 4: 3, 5: 0}, events, SEGMENTS)
    f = obs.features
    assert obs.rows == [(1, 2)]
    assert (f.decode_rows, f.decode_calls, f.decode_layer_rows) == (1, 1, 2)
    assert f.decode_attn == pytest.approx(10 * 2 / 1e3)
    assert (f.prefill_calls, f.prefill_tokens) == (2, 7)
    assert f.prefill_attn == pytest.approx((4 * (5 + 2) + 3 * (0 + 1.5)) * 6 / 1e3)


def test_step_features_deepest_exit_sets_the_segment_calls():
    obs = step_features({1: 3, 2: 4}, {}, {}, [_ev(1, 2), _ev(2, 6)], SEGMENTS)
    assert obs.features.decode_calls == 3 and obs.features.decode_layer_rows == 8
    assert obs.features.prefill_calls == 0
    assert step_features({}, {}, {}, [], SEGMENTS).features == StepFeatures()


def test_timed_steps_match_what_the_engine_did():
    """Summed over a whole run, the features equal what the engine's outputs imply: every prompt token
    prefilled once, one decode row per token after the first at its exit layer and context."""
    cfg = EngineConfig(max_seqs=3, max_running=2, prefill_budget=7, max_len=128)
    engine = Engine(TorchBackend(_model()), cfg, ConfidenceRule(0.2))
    prompts = _prompts(5, seed=2)
    out: dict[int, list[TokenEvent]] = {}
    ids = [engine.submit(Request(p, 6, on_token=lambda e: out.setdefault(e.request_id, []).append(e)))
           for p in prompts]
    steps = []
    while engine.has_work:
        steps.append(timed_step(engine))
    assert steps[0].features.prefill_tokens == 7  # admitted inside the step, counted all the same
    assert all(s.features.prefill_tokens <= 7 and s.seconds > 0 for s in steps)
    total = np.sum([s.features.vector() for s in steps], axis=0)
    got = dict(zip(FEATURES, total))
    layers = [e.exit_layer for i in ids for e in out[i][1:]]
    assert got["prefill_tokens"] == sum(len(p) for p in prompts)
    assert got["decode_rows"] == len(layers) == 5 * 5
    assert got["decode_layer_rows"] == sum(layers)
    assert min(layers) < 6, "threshold 0.2 should make some rows exit early"
    attn = sum((len(p) + k) * e.exit_layer for p, i in zip(prompts, ids) for k, e in enumerate(out[i][1:]))
    assert got["decode_attn"] == pytest.approx(attn / 1e3)
    assert all(out[i][0].exit_layer == 6 for i in ids)  # first tokens: prefill, not decode rows


def test_exits_allowed_mirrors_the_deferral_limit():
    assert exits_allowed(EngineConfig(kv_mode=KVMode.DEFER, defer_exit_max_batch=1), 1)
    assert not exits_allowed(EngineConfig(kv_mode=KVMode.DEFER, defer_exit_max_batch=1), 2)
    assert exits_allowed(EngineConfig(kv_mode=KVMode.DEFER, defer_exit_max_batch=None), 16)
    assert exits_allowed(EngineConfig(kv_mode=KVMode.PROPAGATE, defer_exit_max_batch=1), 16)


# --------------------------------------------------------------------------- scenarios and the driver


def test_generated_scenarios_cover_the_levels_and_fit_the_engine():
    a = generate_scenarios(12, 3, max_seqs=8, max_len=256, budgets=[16, 64, 256], max_output=64)
    assert a == generate_scenarios(12, 3, max_seqs=8, max_len=256, budgets=[16, 64, 256], max_output=64)
    assert a != generate_scenarios(12, 4, max_seqs=8, max_len=256, budgets=[16, 64, 256], max_output=64)
    assert {s.prefill_budget for s in a} == {16, 64, 256} and {s.full_share for s in a} == {0.0, 0.5, 1.0}
    assert 1 in {s.batch for s in a} and max(s.batch for s in a) == 8
    assert all(s.prompt_max + s.max_tokens_min <= 256 for s in a)
    check_scenarios(a, 8, 256)
    with pytest.raises(ConfigError, match=r"scenario_list\[0\].batch 9 exceeds"):
        check_scenarios([Scenario(batch=9)], 8, 256)


def test_profile_run_records_every_scenario_and_traces_bounded_requests():
    cfg = EngineConfig(max_seqs=4, max_running=4, max_len=128, kv_mode=KVMode.DEFER, defer_exit_max_batch=1)
    engine = Engine(TorchBackend(_model()), cfg, ConfidenceRule(0.2))
    pool = _prompts(6, seed=5, lo=30, hi=60)
    scen = [Scenario(prefill_budget=16, batch=2, prompt_min=5, prompt_max=40, full_share=1.0, max_tokens_max=8),
            Scenario(prefill_budget=64, batch=4, prompt_min=5, prompt_max=90, full_share=0.0, max_tokens_max=8)]
    prof = run_profile(engine, pool, (), scen, steps=12, warmup_steps=3, seed=0, trace_steps=10)
    assert [s["group"] for s in prof.steps] == [0] * 12 + [1] * 12  # the trace phase is not fitted
    assert not engine.has_work  # drained after the last phase
    traced = [t for t in prof.traces.values() if t["exit_layers"]]
    assert traced and all(len(t["exit_layers"]) == len(t["exits_allowed"]) for t in traced)
    assert all(t["prompt_len"] <= 90 and len(t["prompt_ids_head"]) == min(64, t["prompt_len"]) for t in traced)
    decoded = sum(s["decode_rows"] for s in prof.steps if s["group"] == 1)
    allowed = sum(s["decode_rows"] for s in prof.steps if s["group"] == 1 and s["exits_allowed"])
    # the trace phase decodes at batch 1 (deferred K/V exits only there): each of its steps adds one token
    # whose step allowed exits, at most 10
    total = sum(len(t["exit_layers"]) for t in traced)
    assert decoded < total <= decoded + 10
    assert allowed < sum(sum(t["exits_allowed"]) for t in traced) <= allowed + 10
    assert sum(prof.exit_fractions([2, 4, 6]).values()) == pytest.approx(1.0)
    X, y, g = design(prof.steps)
    assert X.shape == (24, len(FEATURES)) and (y > 0).all() and set(g) == {0, 1}


# --------------------------------------------------------------------------- config


def test_config_validation_names_the_field():
    for kw, word in [(dict(holdout=1.0), "holdout"), (dict(threads=0), "threads"), (dict(budgets=[]), "budgets"),
                     (dict(warmup_steps=-1), "warmup_steps"), (dict(steps_per_scenario=0), "steps_per_scenario"),
                     (dict(serving_runs=[[512]]), "serving_runs"), (dict(serving_runs=[[512, 3.0]]), "serving_runs"),
                     (dict(serving_runs=[]), "serving_runs"), (dict(serving_duration_s=0), "serving_duration_s"),
                     (dict(serving_warmup_requests=-1), "serving_warmup_requests"),
                     (dict(serving_starts=0), "serving_starts"),
                     (dict(serving_edge_run=[128]), "serving_edge_run"),
                     (dict(serving_edge_run=[0, 0.8]), "serving_edge_run"),
                     (dict(serving_edge_run=[128, 0.0]), "serving_edge_run")]:
        with pytest.raises(ConfigError, match=word):
            ProfileConfig(**kw)
    with pytest.raises(ConfigError, match="full_share"):
        Scenario(full_share=1.5)
    assert ProfileConfig(serving_edge_run=None).serving_edge_run is None
    assert ProfileConfig(serving_edge_run=["64", "0.5"]).serving_edge_run == (64, 0.5)


def test_scenario_list_from_overrides():
    cfg = apply(ProfileConfig(), {"scenario_list": "[{prefill_budget: 32, batch: 2}, {batch: 1}]"})
    assert [s.batch for s in cfg.scenario_list] == [2, 1] and cfg.scenario_list[0].prefill_budget == 32
    assert asdict(cfg)["scenario_list"][1]["batch"] == 1
    with pytest.raises(ConfigError, match="batch"):
        apply(ProfileConfig(), {"scenario_list": "[{batch: 0}]"})


def test_missing_bundle_names_the_path_and_the_stage(tmp_path):
    with pytest.raises(ConfigError, match=r"no serving bundle at .*nowhere.*smartexit repo"):
        main(ProfileConfig(run_dir=str(tmp_path), bundle=str(tmp_path / "nowhere")))
    assert not (tmp_path / "scheduler").exists()


# --------------------------------------------------------------------------- the fit


def _synthetic(n_groups=12, per=40, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    true = dict(one=2e-4, decode_calls=1e-3, decode_rows=3e-4, decode_layer_rows=2e-5, decode_attn=5e-4,
                prefill_calls=2e-3, prefill_tokens=1e-4, prefill_attn=3e-5)
    rows, groups = [], []
    for g in range(n_groups):
        for _ in range(per):
            b = int(rng.integers(0, 17))
            exits = rng.choice([3, 9, 12], size=b).tolist()
            ctx = rng.integers(8, 500, size=b).tolist()
            chunks = [(int(rng.integers(0, 300)), int(rng.integers(1, 200))) for _ in range(int(rng.integers(0, 3)))]
            if not exits and not chunks:
                chunks = [(0, 16)]
            rows.append(combine(decode_features(exits, ctx, [3, 9, 12]), prefill_features(chunks, 12)).vector())
            groups.append(g)
    X = np.stack(rows)
    w = np.array([true[f] for f in FEATURES])
    y = X @ w * (1 + noise * rng.standard_normal(len(X)))
    return X, y, np.array(groups), true


def test_fit_recovers_known_coefficients():
    X, y, g, true = _synthetic()
    m = fit_latency(X, y, 12, [3, 9, 12], groups=g)
    # 1% multiplicative noise on ~500 points: the dominant terms come back within a few percent
    for f in ("decode_rows", "decode_attn", "prefill_calls", "prefill_tokens", "prefill_attn"):
        assert m.coef[f] == pytest.approx(true[f], rel=0.1), f
    assert m.fit["test_rel_err_median"] < 0.02 and m.fit["test_scenarios"] == 3
    assert m.fit["test_points"] == int(np.isin(g, list(held_out_groups(g, 0.25, 0))).sum())
    assert all(v >= 0 for v in m.coef.values())


def test_fit_refuses_too_little_data():
    X, y, g, _ = _synthetic(n_groups=2, per=10)
    with pytest.raises(ConfigError, match="too small to fit: 20 steps, at least 32"):
        fit_latency(X, y, 12, [3, 9, 12], groups=g)
    X, y, g, _ = _synthetic(n_groups=1, per=60)
    with pytest.raises(ConfigError, match="one scenario"):
        fit_latency(X, y, 12, [3, 9, 12], groups=g)
    with pytest.raises(ConfigError, match="X must be"):
        fit_latency(X[:, :3], y, 12, [3, 9, 12], groups=g)


def test_latency_model_round_trip_and_refusals(tmp_path):
    X, y, g, _ = _synthetic(n_groups=4, per=20)
    m = fit_latency(X, y, 12, [3, 9, 12], groups=g)
    m.save(tmp_path / "latency.json")
    back = LatencyModel.load(tmp_path / "latency.json")
    assert back.coef == m.coef and back.fit == m.fit
    assert back.seconds(StepFeatures(decode_rows=1)) == pytest.approx(m.coef["one"] + m.coef["decode_rows"])
    d = json.loads((tmp_path / "latency.json").read_text())
    (tmp_path / "old.json").write_text(json.dumps({**d, "format": FORMAT + 1}))
    with pytest.raises(ConfigError, match="format"):
        LatencyModel.load(tmp_path / "old.json")
    (tmp_path / "layout.json").write_text(json.dumps({**d, "coef": {"one": 1e-3}}))
    with pytest.raises(ConfigError, match="another feature layout"):
        LatencyModel.load(tmp_path / "layout.json")
    with pytest.raises(ConfigError, match="no such file"):
        LatencyModel.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="must end at num_layers"):
        LatencyModel(coef=m.coef, num_layers=12, exit_layers=[3, 9])
