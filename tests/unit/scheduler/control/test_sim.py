"""The serving simulator: exact timings on hand-checked cases, the budget's trade-off, admission,
overload, exit depth, and the statistics a policy reads (keys the live host also answers with)."""
from __future__ import annotations

import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.control.outcomes import summarize
from scheduler.control.latency import FEATURES, LatencyModel
from scheduler.control.policies import FixedBudget, observation_from_stats
from scheduler.control.exit_model import ExitModel
from scheduler.control.sim import Simulator, simulate
from scheduler.control.sim_config import SimConfig
from scheduler.control.workload import Arrivals, Workload, synthetic

LAYERS = [3, 9, 12]


def _lm(**coef) -> LatencyModel:
    return LatencyModel({f: float(coef.get(f, 0.0)) for f in FEATURES}, 12, LAYERS)


def _w(arrivals, prompts, outputs) -> Workload:
    return Workload(np.asarray(arrivals, float), np.asarray(prompts, np.int64), np.asarray(outputs, np.int64), "test")


FULL = ExitModel(LAYERS, [0, 0, 1])


def test_one_request_has_the_hand_computed_ttft_and_tpot():
    # step = 1 ms + 0.1 ms per prefill token + 2 ms per decode row; prompt 30 at budget 16: two
    # prefill steps (1 + 1.6, 1 + 1.4 ms), then 4 decode steps of 3 ms
    lm = _lm(one=1e-3, prefill_tokens=1e-4, decode_rows=2e-3)
    sim = simulate(lm, FULL, SimConfig(prefill_budget=16), _w([0.5], [30], [5]), FixedBudget(16, 16), tick_s=0.1)
    (r,) = sim.results()
    assert r.ttft_s == pytest.approx(2.6e-3 + 2.4e-3)
    assert r.tpot_s == pytest.approx(3e-3)
    assert r.t_submit == 0.5 and r.tokens == 5 and r.ok


def test_serving_overheads_add_to_first_and_later_tokens():
    lm = _lm(one=1e-3)
    cfg = SimConfig(ttft_overhead_ms=20, token_overhead_ms=2)
    (r,) = simulate(lm, FULL, cfg, _w([0.0], [8], [3]), FixedBudget(128, 16)).results()
    assert r.ttft_s == pytest.approx(1e-3 + 0.020)
    # the last token leaves 2 steps after the first, with the per-token overhead instead of the first's
    assert r.t_end - r.t_first_token == pytest.approx(2e-3 + 0.002 - 0.020)


def test_the_front_end_queues_requests_one_at_a_time():
    """SimConfig.ingress_ms: sparse arrivals each wait exactly the front end's time; a burst queues there,
    so the delay grows with load (the k-th of a burst waits k times as long) as a constant overhead cannot."""
    lm = _lm(one=1e-3)
    base, front = SimConfig(), SimConfig(ingress_ms=50)
    sparse = _w([0.0, 1.0, 2.0], [8] * 3, [2] * 3)
    plain = [r.ttft_s for r in simulate(lm, FULL, base, sparse, FixedBudget(128, 16)).results()]
    queued = [r.ttft_s for r in simulate(lm, FULL, front, sparse, FixedBudget(128, 16)).results()]
    assert queued == pytest.approx([t + 0.050 for t in plain])
    burst = _w([0.0] * 4, [8] * 4, [2] * 4)
    ttft = [r.ttft_s for r in simulate(lm, FULL, front, burst, FixedBudget(128, 16)).results()]
    assert [round(t, 3) for t in ttft] == pytest.approx([0.051, 0.101, 0.151, 0.201], abs=2e-3)
    with pytest.raises(ConfigError, match="ingress_ms"):
        SimConfig(ingress_ms=-1)


def test_the_front_ends_work_slows_the_engine_while_requests_arrive():
    """SimConfig.front_decode_per_arrival: each request that reached the engine in the last FRONT_WINDOW_S
    seconds adds its factor to the decode slowdown: a lone request decodes at the base speed, the same
    request among a burst of arrivals slower by the burst's size, and a request alone again once the
    window has passed (the host's step log counts the same arrivals: scheduler/loadtest/serving_path.py)."""
    from edge.runtime.host_steplog import FRONT_WINDOW_S

    lm = _lm(one=1e-3)
    lone = _w([0.0], [8], [11])
    base = simulate(lm, FULL, SimConfig(), lone, FixedBudget(128, 16)).results()[0]
    slowed = simulate(lm, FULL, SimConfig(front_decode_per_arrival=0.5), lone, FixedBudget(128, 16)).results()[0]
    # one arrival in the window: every step of the lone request at 1 + 0.5 the base time
    assert slowed.tpot_s == pytest.approx(base.tpot_s * 1.5, rel=1e-6)
    burst = _w([0.0] * 4 + [FRONT_WINDOW_S + 1.0], [8] * 5, [11] * 5)
    res = simulate(lm, FULL, SimConfig(front_decode_per_arrival=0.5), burst, FixedBudget(128, 16)).results()
    assert res[0].tpot_s == pytest.approx(base.tpot_s * 3.0, rel=1e-6)  # 4 arrivals: x(1 + 4 x 0.5)
    assert res[4].tpot_s == pytest.approx(slowed.tpot_s, rel=1e-6)  # the burst is out of the window
    with pytest.raises(ConfigError, match="per-arrival"):
        SimConfig(front_prefill_per_arrival=-0.1)


def _heavy() -> Workload:
    return synthetic(300, 12.0, Arrivals.POISSON, seed=2, prompt_mean=300, output_mean=24)


def test_a_larger_budget_trades_time_per_token_for_time_to_first_token():
    lm = _lm(one=1e-3, decode_rows=0.3e-3, prefill_calls=0.5e-3, prefill_tokens=0.15e-3)
    small = summarize(simulate(lm, FULL, SimConfig(), _heavy(), FixedBudget(16, 16)).results(), 500, 50)
    large = summarize(simulate(lm, FULL, SimConfig(), _heavy(), FixedBudget(512, 16)).results(), 500, 50)
    assert large["ttft_p50_ms"] < small["ttft_p50_ms"]
    assert large["tpot_p95_ms"] > small["tpot_p95_ms"]


class _Spy(FixedBudget):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.running: list[int] = []

    def act(self, obs):
        self.running.append(obs.running)
        return super().act(obs)


def test_admission_limit_holds_and_the_queue_refuses_above_max_waiting():
    lm = _lm(one=5e-3, prefill_tokens=1e-4, decode_rows=1e-3)
    spy = _Spy(64, 3)
    sim = simulate(lm, FULL, SimConfig(max_waiting=4), _w([0.0] * 20, [40] * 20, [30] * 20), spy, tick_s=0.01)
    assert max(spy.running) == 3
    res = sim.results()
    # all arrive before the first step: 4 queue, the rest are refused (as the host's submit refuses
    # what finds max_waiting requests not yet admitted)
    assert sum(r.error_kind == "overloaded" for r in res) == 16
    assert sim.rejected_total == 16 and all(r.ok for r in res if r.error_kind is None)


def test_shedding_refuses_what_waits_past_its_ttft_deadline_as_the_host_does():
    """Admission limit 1, 10 requests at once, TTFT target 50 ms, each request ~40 ms in the engine:
    with shed_late the ones still waiting at 50 ms are refused (error "shed", a miss) and the admitted
    run on; without it all are served, most late. Shedding frees the engine for later arrivals: of a
    second burst 0.3 s later (when the unshed backlog is still running), more meet the SLA."""
    lm = _lm(one=1e-3, prefill_tokens=1e-4, decode_rows=1e-3)
    w = _w([0.0] * 10 + [0.3] * 3, [40] * 13, [20] * 13)
    shed = simulate(lm, FULL, SimConfig(sla_ttft_ms=50, sla_tpot_ms=1000, shed_late=True), w, FixedBudget(64, 1),
                    tick_s=0.01)
    keep = simulate(lm, FULL, SimConfig(sla_ttft_ms=50, sla_tpot_ms=1000), w, FixedBudget(64, 1), tick_s=0.01)
    rs, rk = shed.results(), keep.results()
    assert all(r.ok for r in rk) and keep.shed_total == 0
    shed_ids = [r.request_id for r in rs if r.error_kind == "shed"]
    assert shed.shed_total == len(shed_ids) >= 7  # the first one or two of the burst get in by 50 ms
    assert all(r.ok for r in rs if r.error_kind is None) and sum(r.ok for r in rs) == 13 - len(shed_ids)
    assert all(r.t_end - r.t_submit == pytest.approx(0.05, abs=0.02) for r in rs if r.error_kind == "shed")
    late_burst = lambda res: sum(r.ok and r.ttft_s <= 0.05 for r in res[10:])  # noqa: E731
    assert late_burst(rs) > late_burst(rk)
    assert shed.observe()["shed_total"] == shed.shed_total


def test_early_exits_make_decoding_cheaper():
    lm = _lm(one=1e-3, decode_layer_rows=0.2e-3, decode_calls=0.2e-3)
    w = _w([0.0] * 8, [16] * 8, [64] * 8)
    full = summarize(simulate(lm, FULL, SimConfig(), w, FixedBudget()).results(), 1e9, 1e9)
    early = summarize(simulate(lm, ExitModel(LAYERS, [0.6, 0.2, 0.2]), SimConfig(exit_max_batch=None), w,
                               FixedBudget()).results(), 1e9, 1e9)
    # the engine lets rows exit only at small batches (defer mode): 8 rows decode at full depth
    capped = summarize(simulate(lm, ExitModel(LAYERS, [0.6, 0.2, 0.2]), SimConfig(exit_max_batch=4), w,
                                FixedBudget()).results(), 1e9, 1e9)
    assert capped["tpot_p50_ms"] == pytest.approx(full["tpot_p50_ms"])
    assert early["tpot_p50_ms"] < 0.8 * full["tpot_p50_ms"]


def test_observation_has_the_hosts_keys_and_parses():
    lm = _lm(one=2e-3, prefill_tokens=1e-4, decode_rows=1e-3)
    sim = Simulator(lm, ExitModel(LAYERS, [0.2, 0.3, 0.5]), SimConfig(), _heavy())
    sim.advance(3.0)
    st = sim.observe()
    o = observation_from_stats(st)
    assert o.running == st["running"] <= 16 and o.free_slots == 16 - o.running
    assert 3 <= o.predicted_exit_layer <= 12 and o.arrival_rate_rps > 0
    assert st["finished_total"] > 0 and o.recent_ttft_p95_ms is not None
    c = sim.take_counts()
    assert c.tokens_on_time + c.tokens_late == sim.tokens_total and sim.take_counts().finished == 0


def test_seeded_runs_repeat_and_seeds_differ():
    lm = _lm(one=1e-3, decode_layer_rows=1e-4, prefill_tokens=1e-4)
    ex = ExitModel(LAYERS, [0.2, 0.3, 0.5])
    a, b, c = (simulate(lm, ex, SimConfig(seed=s), _heavy(), FixedBudget()).results() for s in (1, 1, 2))
    assert [r.t_end for r in a] == [r.t_end for r in b]
    assert [r.t_end for r in a] != [r.t_end for r in c]


def test_exit_model_fit_recovers_marginal_and_concentration():
    rng = np.random.default_rng(0)
    true = ExitModel(LAYERS, [0.1, 0.25, 0.65], concentration=6.0)
    traces = [list(rng.choice(LAYERS, size=200, p=true.request_probs(rng))) for _ in range(400)]
    fit = ExitModel.fit(LAYERS, traces)
    assert np.allclose(fit.fractions, true.fractions, atol=0.02)
    assert 4.0 < fit.concentration < 9.0  # method of moments on 400 requests: within ~30%
    with pytest.raises(ConfigError, match="at least 4"):
        ExitModel.fit(LAYERS, traces[:3])


@pytest.mark.parametrize("kw", [{"max_seqs": 0}, {"sla_ttft_ms": 0}, {"ttft_overhead_ms": -1}])
def test_bad_sim_config_is_refused(kw):
    with pytest.raises(ConfigError):
        SimConfig(**kw)


def test_mismatched_exit_model_and_latency_model_are_refused():
    with pytest.raises(ConfigError, match="exit model ends at layer 8"):
        Simulator(_lm(one=1e-3), ExitModel([4, 8], [0.5, 0.5]), SimConfig(), _heavy())


def test_the_serving_paths_cost_per_chunk_lengthens_the_step():
    """Four requests prefilled in one step hand over four chunks: at 5 ms of engine time per chunk
    the step lasts 1 + 4 x 5 ms, and all four first tokens leave at its end."""
    lm = _lm(one=1e-3)
    res = simulate(lm, FULL, SimConfig(serve_chunk_ms=5.0), _w([0.0] * 4, [8] * 4, [1] * 4), FixedBudget(128, 16)).results()
    assert [r.ttft_s for r in res] == pytest.approx([1e-3 + 4 * 5e-3] * 4)
    # and per chunk squared (the stack's contention grows with the streams a step feeds)
    sim = simulate(lm, FULL, SimConfig(serve_chunk_ms=5.0, serve_chunk_sq_ms=0.5), _w([0.0] * 4, [8] * 4, [1] * 4),
                   FixedBudget(128, 16))
    assert [r.ttft_s for r in sim.results()] == pytest.approx([1e-3 + 4 * 5e-3 + 16 * 0.5e-3] * 4)
    assert sim.emit_seconds_total == pytest.approx(4 * 5e-3 + 16 * 0.5e-3) and sim.chunks_total == 4


def test_draft_rounds_emit_several_tokens_in_a_step():
    """With the served engine's rounds (SimConfig.decode_rounds) a sequence decoding alone verifies a round of
    three tokens a step: every token delivered, in a third of the steps, each round priced round_ms outside the
    batched step, and a shorter time per output token; a batch size without a count takes plain steps."""
    from scheduler.control.sim import simulate
    from scheduler.control.sim_config import SimConfig, batch_bucket
    from scheduler.control.policies import FixedBudget

    lm = _lm(one=1e-3, decode_rows=0.5e-3, prefill_tokens=0.1e-3, prefill_calls=1e-3)
    w = _w([0.0, 10.0], [32, 32], [31, 31])  # one request at a time
    ex = ExitModel([3, 9, 12], [0.5, 0.0, 0.5])
    plain = simulate(lm, ex, SimConfig(), w, FixedBudget(128, 4))
    rounds = simulate(lm, ex, SimConfig(decode_rounds={"1": [0.0, 0.0, 0.0, 1.0]}, round_ms=0.7), w,
                      FixedBudget(128, 4))
    other = simulate(lm, ex, SimConfig(decode_rounds={"2": [0.0, 0.0, 0.0, 1.0]}), w, FixedBudget(128, 4))
    assert plain.tokens_total == rounds.tokens_total == other.tokens_total == 62
    assert rounds.steps_total == 2 * (1 + 10) and plain.steps_total == other.steps_total == 2 * 31
    tpot = lambda run: np.mean([r.tpot_s for r in run.results()])
    assert tpot(rounds) == pytest.approx((1e-3 + 0.7e-3) / 3, rel=0.02)  # a round: the step's constant + round_ms
    # a price for the batch's bucket, where the step log measured one, overrides round_ms; another bucket's does not
    by = simulate(lm, ex, SimConfig(decode_rounds={"1": [0.0, 0.0, 0.0, 1.0]}, round_ms=0.7,
                                    round_ms_by_batch={"1": 0.4, "2": 3.0}), w, FixedBudget(128, 4))
    assert tpot(by) == pytest.approx((1e-3 + 0.4e-3) / 3, rel=0.02)
    with pytest.raises(ConfigError, match="round_ms_by_batch"):
        SimConfig(round_ms_by_batch={"7": 1.0})
    with pytest.raises(ConfigError, match="round_ms_by_batch"):
        SimConfig(round_ms_by_batch={"1": -1.0})
    assert tpot(other) == pytest.approx(tpot(plain)) and tpot(rounds) < 0.6 * tpot(plain)
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == ["1", "2", "3-4", "3-4", "5-8", "5-8", "9+", "9+"]
    with pytest.raises(ConfigError, match="decode_rounds"):
        SimConfig(decode_rounds={"1": [0.5, 0.4]})
    with pytest.raises(ConfigError, match="decode_rounds"):
        SimConfig(decode_rounds={"7": [1.0]})
