"""The gymnasium environment: gymnasium's own checker, seeding, bounds, the reward's arithmetic and
the observation layout's fingerprint."""
from __future__ import annotations

import numpy as np
import pytest

from edge.core.errors import ConfigError
from scheduler.control import env as env_mod
from scheduler.control.env import (ACTIONS, OBS_LAYOUT, EnvConfig, RewardConfig, SchedulerEnv, action_of, estimate_capacity, index_of,
                           layout_id, obs_vector, reward_of)
from scheduler.control.exit_model import ExitModel
from scheduler.control.latency import FEATURES, LatencyModel
from scheduler.control.policies import ControlAction, FixedBudget, observation_from_stats
from scheduler.control.sim import TickCounts

LM = LatencyModel({f: 0.0 for f in FEATURES} | {"one": 1e-3, "decode_rows": 0.3e-3, "prefill_tokens": 0.15e-3,
                                                 "prefill_calls": 0.5e-3, "decode_layer_rows": 2e-5}, 12, [3, 9, 12])
EX = ExitModel([3, 9, 12], [0.1, 0.23, 0.67])


def _env(**kw) -> SchedulerEnv:
    return SchedulerEnv(LM, EX, EnvConfig(episode_s=10.0, capacity_rps=15.0, **kw))


def test_gymnasium_checker_passes():
    from gymnasium.utils.env_checker import check_env

    check_env(_env(), skip_render_check=True)


def _rollout(env: SchedulerEnv, seed: int, actions: list[int]) -> tuple[list[np.ndarray], list[float]]:
    obs, _ = env.reset(seed=seed)
    seen, rewards = [obs], []
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        seen.append(obs)
        rewards.append(r)
        if term or trunc:
            break
    return seen, rewards


def test_seeded_episodes_repeat_and_stay_in_bounds():
    acts = [i % len(ACTIONS) for i in range(60)]
    a, ra = _rollout(_env(), 5, acts)
    b, rb = _rollout(_env(), 5, acts)
    c, rc = _rollout(_env(), 6, acts)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and ra == rb
    assert ra != rc
    assert all(((x >= -1) & (x <= 1)).all() and x.dtype == np.float32 for x in a)
    assert sum(ra) > 0  # tokens were delivered


def test_episodes_truncate_at_the_episode_length():
    env = _env()
    env.reset(seed=1)
    steps, trunc, term = 0, False, False
    while not (trunc or term):
        *_, term, trunc, _ = env.step(0)
        steps += 1
    assert steps <= int(10.0 / 0.25) + 1


def test_reward_counts_on_time_tokens_violations_and_energy():
    c = TickCounts(tokens_on_time=250, violations=2, busy_s=0.5)
    assert reward_of(c, RewardConfig()) == pytest.approx((250 - 64) / 100)
    assert reward_of(c, RewardConfig(energy_tokens_per_s=100)) == pytest.approx((250 - 64 - 50) / 100)


def test_actions_round_trip_and_respect_max_seqs():
    for i in range(len(ACTIONS)):
        assert index_of(action_of(i, 16)) == i
    assert action_of(len(ACTIONS) - 1, 4).max_running == 4
    assert index_of(ControlAction(100, 15)) == ACTIONS.index((128, 16))


def test_observation_vector_reads_live_host_stats_without_the_recent_measurements():
    # no tail latencies or arrival rate measured yet: the vector is still in bounds. The SLA and the largest
    # chunk are settings the host always reports; a host without them is refused, not given a made-up value
    stats = {"waiting": 3, "prefill_backlog_tokens": 500, "running": 16, "free_slots": 0, "prefill_budget": 128,
             "max_running": 16, "max_seqs": 16, "num_layers": 12, "predicted_exit_layer": 10.5, "min_slack_ms": -40.0,
             "sla_ttft_ms": 1000.0, "sla_tpot_ms": 100.0, "max_chunk": None}
    v = obs_vector(observation_from_stats(stats))
    assert v.shape == (len(env_mod.OBS_LAYOUT),) and (np.abs(v) <= 1).all()
    for key in ("sla_ttft_ms", "max_chunk"):
        with pytest.raises(ConfigError, match=f"engine stats lack '{key}'"):
            observation_from_stats({k: v for k, v in stats.items() if k != key})


def test_layout_fingerprint_changes_with_the_layout(monkeypatch):
    before = layout_id()
    monkeypatch.setattr(env_mod, "OBS_LAYOUT", env_mod.OBS_LAYOUT + ("extra",))
    assert env_mod.layout_id() != before


def test_capacity_estimate_is_where_attainment_drops():
    cfg = EnvConfig(episode_s=20.0)
    cap = estimate_capacity(LM, EX, cfg, FixedBudget(128, 16), duration_s=20.0)
    assert 1.0 < cap < 1e3


def test_capacity_judges_every_rate_on_enough_requests(monkeypatch):
    """A rate is judged on at least CAPACITY_MIN_REQUESTS expected requests however short ``duration_s``: on a
    few dozen, two overlapping long prompts read as a miss of the 95% and turn the bisection down for good."""
    judged = []
    real = env_mod.make_workload

    def spy(pattern, rate, duration_s, seed, cfg):
        judged.append(rate * duration_s)
        return real(pattern, rate, duration_s, seed, cfg)
    monkeypatch.setattr(env_mod, "make_workload", spy)
    cap = estimate_capacity(LM, EX, EnvConfig(episode_s=20.0), FixedBudget(128, 16), duration_s=20.0)
    assert judged and min(judged) >= env_mod.CAPACITY_MIN_REQUESTS - 1e-6
    assert 1.0 < cap < 1e3


@pytest.mark.parametrize("kw", [{"patterns": ("weekly",)}, {"load_range": (0.0, 1.0)}, {"tick_s": 0.0}])
def test_bad_env_config_is_refused(kw):
    with pytest.raises(ConfigError):
        EnvConfig(**kw)


def test_the_exit_depth_ablation_holds_its_features_at_zero():
    from scheduler.control.env import EXIT_FEATURES
    from scheduler.control.policies import ControlObservation

    o = ControlObservation(waiting=3, prefill_backlog_tokens=400, running=5, free_slots=11, prefill_budget=128,
                           max_running=16, max_seqs=16, num_layers=12, predicted_exit_layer=6.0, min_slack_ms=50.0,
                           oldest_waiting_slack_ms=100.0, recent_ttft_p95_ms=300.0, recent_tpot_p95_ms=20.0,
                           arrival_rate_rps=4.0, sla_ttft_ms=500.0, sla_tpot_ms=50.0)
    full, masked = obs_vector(o), obs_vector(o, EXIT_FEATURES)
    i = OBS_LAYOUT.index("predicted_exit_depth")
    assert full[i] == pytest.approx(0.5) and masked[i] == 0.0
    assert np.array_equal(np.delete(full, i), np.delete(masked, i))  # nothing else changes
    env = SchedulerEnv(LM, EX, EnvConfig(episode_s=5.0, capacity_rps=5.0, masked=EXIT_FEATURES))
    obs, _ = env.reset(seed=0)
    for _ in range(5):
        obs, *_ = env.step(0)
        assert obs[i] == 0.0  # the training environment holds it at 0 too
    with pytest.raises(ConfigError, match="env.masked"):
        EnvConfig(masked=("exit_depth_typo",))


def test_a_workload_familys_capacity_judges_every_rate_on_enough_requests(monkeypatch):
    """bench scheduler's per-workload capacity (evaluate.spec_capacity) too: its cells may be short."""
    from scheduler.control import evaluate as ev

    judged, windows = [], []
    real = ev.workload_for

    def spy(spec, rate, duration_s, cfg):
        judged.append(rate * duration_s)
        windows.append(duration_s)
        return real(spec, rate, duration_s, cfg)
    monkeypatch.setattr(ev, "workload_for", spy)
    cap = ev.spec_capacity(LM, EX, EnvConfig(episode_s=20.0), ev.WorkloadSpec("poisson-s1", "poisson", 1),
                           FixedBudget(128, 16), duration_s=20.0)
    assert judged and min(judged) >= env_mod.CAPACITY_MIN_REQUESTS - 1e-6
    assert 1.0 < cap < 1e3
    # a diurnal cycle keeps its window: a longer one would be another workload
    windows.clear()
    ev.spec_capacity(LM, EX, EnvConfig(episode_s=20.0), ev.WorkloadSpec("diurnal-s1", "diurnal", 1),
                     FixedBudget(128, 16), duration_s=20.0)
    assert windows and set(windows) == {20.0}
