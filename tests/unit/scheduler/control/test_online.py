"""Online fine-tuning and the fallback guard: the live reward's arithmetic (= the training reward), a PPO
update on recorded live transitions (swapped in, acting on), and the guard's decisions window by window."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.core.errors import ConfigError
from scheduler.control.env import RewardConfig, obs_vector, reward_of
from scheduler.control.learned import LearnedPolicy
from scheduler.control.online import FallbackGuard, GuardedPolicy, OnlineTuner, TuneStats, live_reward
from scheduler.control.policies import ControlAction, FixedBudget
from scheduler.control.sim import TickCounts
from tests.unit.scheduler.control.test_learned import observations, tiny_model


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def counters(on_time: int = 0, late: int = 0, refused: int = 0, finished: int = 0, met: int = 0) -> dict:
    return {"tokens_on_time_total": on_time, "violations_total": late, "rejected_total": refused,
            "finished_total": finished, "sla_met_total": met}


# ------------------------------------------------------------------------------------------- reward

def test_live_reward_is_the_training_reward():
    cfg = RewardConfig(violation_tokens=32.0, energy_tokens_per_s=10.0, reward_scale=100.0)
    prev, now = counters(1000, 3, 1), counters(1250, 5, 4)
    assert live_reward(prev, now, cfg) == pytest.approx((250 - 32 * (2 + 3)) / 100)
    assert live_reward(prev, now, cfg, busy_s=0.5) == pytest.approx((250 - 32 * 5 - 5) / 100)
    # the simulator counts refusals as violations; the host keeps them apart: the same reward either way
    assert live_reward(prev, now, cfg, busy_s=0.5) == pytest.approx(
        reward_of(TickCounts(tokens_on_time=250, violations=5, busy_s=0.5), cfg))
    assert live_reward(now, now, cfg) == 0.0


def test_live_reward_after_a_host_restart_counts_from_zero():
    assert live_reward(counters(5000, 9, 9), counters(40, 1, 0), RewardConfig()) == pytest.approx((40 - 32) / 100)


def test_live_reward_names_a_missing_counter():
    with pytest.raises(ConfigError, match="engine stats lack 'rejected_total'"):
        live_reward(counters(), {"tokens_on_time_total": 1, "violations_total": 0}, RewardConfig())


# ------------------------------------------------------------------------------------------- tuning

def _fill(policy: LearnedPolicy, tuner: OnlineTuner, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    policy.reset()
    for o in observations(n, seed=seed):
        idx = policy.act_vector(obs_vector(o))
        step = policy.last_step
        tuner.record(step.obs, idx, float(rng.normal(1.0 if idx % 2 else -1.0, 0.1)), step.episode_start)


def test_update_changes_the_parameters_and_the_policy_still_acts():
    policy = LearnedPolicy(tiny_model(seed=2))
    before = {k: v.clone() for k, v in policy.model.policy.state_dict().items()}
    tuner = OnlineTuner(policy, n_steps=32, batch_size=16, n_epochs=2, learning_rate=1e-2, target_kl=None)
    _fill(policy, tuner, 31)
    assert not tuner.ready and tuner.update() is None  # fewer than n_steps: nothing to do
    _fill(policy, tuner, 1, seed=5)
    assert tuner.ready
    stats = tuner.update()
    assert isinstance(stats, TuneStats) and stats.updates == 1 and stats.transitions == 32
    assert all(np.isfinite([stats.policy_loss, stats.value_loss, stats.approx_kl]))
    after = policy.model.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not tuner.ready
    assert isinstance(policy.act(observations(1)[0]), ControlAction)


def test_record_refuses_a_step_the_policy_did_not_take():
    policy = LearnedPolicy(tiny_model())
    tuner = OnlineTuner(policy, n_steps=8, batch_size=8)
    with pytest.raises(ValueError, match="did not act on"):
        tuner.record(np.zeros(12, np.float32), 0, 1.0, True)  # nothing acted yet
    idx = policy.act_vector(obs_vector(observations(1)[0]))
    with pytest.raises(ValueError, match="did not act on"):
        tuner.record(policy.last_step.obs, (idx + 1) % 18, 1.0, True)


def test_update_in_a_thread_while_the_policy_acts():
    """The serving loop keeps acting while a thread trains; the trained copy is swapped in whole."""
    policy = LearnedPolicy(tiny_model(seed=4))
    tuner = OnlineTuner(policy, n_steps=64, batch_size=32, n_epochs=3, learning_rate=1e-2, target_kl=None)
    _fill(policy, tuner, 64)
    acting = policy.model.policy
    out: list = []
    worker = threading.Thread(target=lambda: out.append(tuner.update()))
    worker.start()
    actions = [policy.act(o) for o in observations(200, seed=9)]
    worker.join()
    assert len(actions) == 200 and out[0] is not None and out[0].updates == 1
    assert policy.model.policy is not acting  # swapped, not trained in place


def test_tuner_takes_a_network_fresh_from_training():
    """A network that just ran a training forward (behaviour cloning, PPO) holds graph tensors."""
    from scheduler.control.learned import zero_states

    model = tiny_model(seed=7)
    net = model.policy
    obs = torch.as_tensor(np.stack([obs_vector(o) for o in observations(4)]))
    net.evaluate_actions(obs, torch.zeros(4), zero_states(net), torch.zeros(4))[1].sum().backward()
    policy = LearnedPolicy(model)
    tuner = OnlineTuner(policy, n_steps=8, batch_size=8)
    _fill(policy, tuner, 8)
    assert tuner.update().updates == 1


def test_tuner_settings_are_validated():
    policy = LearnedPolicy(tiny_model())
    with pytest.raises(ConfigError, match="batch_size <= n_steps"):
        OnlineTuner(policy, n_steps=8, batch_size=16)
    with pytest.raises(ConfigError, match="clip_range in"):
        OnlineTuner(policy, clip_range=1.5)


# ------------------------------------------------------------------------------------------- the guard

def feed(guard: FallbackGuard, windows: list[tuple[int, int]], t0: float = 0.0) -> list[str]:
    """Run ``windows`` of (finished, met) through ``guard``, one tick at each window's start and end; returns
    the active policy during each window."""
    fin = met = 0
    t = t0
    guard.observe(counters(finished=fin, met=met), t)
    active = []
    for n, m in windows:
        active.append(guard.active)
        guard.observe(counters(finished=fin + n // 2, met=met + m // 2), t + guard.window_s / 2)  # mid-window
        fin, met, t = fin + n, met + m, t + guard.window_s
        guard.observe(counters(finished=fin, met=met), t)
    return active


def test_first_window_probes_then_learned_controls():
    g = FallbackGuard(window_s=30, min_requests=20, probe_every=4, cooldown_windows=2)
    assert g.active == "heuristic"
    assert feed(g, [(40, 38)] * 9) == ["heuristic", "learned", "learned", "learned", "heuristic", "learned",
                                       "learned", "learned", "heuristic"]
    assert g.reference == pytest.approx(0.95) and g.fallbacks == 0 and g.events == [] and g.windows == 9


def test_worse_learned_window_falls_back_for_the_cooldown_then_returns(caplog):
    g = FallbackGuard(window_s=30, min_requests=20, probe_every=10, cooldown_windows=3)
    with caplog.at_level(logging.WARNING, logger="scheduler.control.online"):
        active = feed(g, [(40, 38), (40, 30), (40, 39), (40, 39), (40, 39), (40, 39)])
    assert active == ["heuristic", "learned", "heuristic", "heuristic", "heuristic", "learned"]
    assert g.fallbacks == 1
    fb = g.events[0]
    assert fb["kind"] == "fallback" and fb["learned_attainment"] == pytest.approx(0.75)
    assert fb["heuristic_attainment"] == pytest.approx(0.95) and fb["requests"] == 40 and fb["time"] == 60.0
    assert g.events[1]["kind"] == "return" and g.events[1]["time"] == 150.0
    assert "0.750" in caplog.text and "0.950" in caplog.text
    assert g.reference == pytest.approx(39 / 40)  # the fallback windows refreshed it


@pytest.mark.parametrize("learned_met", [38, 39, 40])
def test_equal_or_better_learned_window_keeps_control(learned_met):
    g = FallbackGuard(min_requests=20, probe_every=10)
    assert feed(g, [(40, 38)] + [(40, learned_met)] * 5) == ["heuristic"] + ["learned"] * 5
    assert g.fallbacks == 0 and g.events == []


def test_too_few_requests_decide_nothing():
    g = FallbackGuard(min_requests=20, probe_every=10)
    assert feed(g, [(40, 38), (19, 0), (5, 0)]) == ["heuristic", "learned", "learned"]
    assert g.fallbacks == 0
    g = FallbackGuard(min_requests=20, probe_every=3)  # a probe with too few: no reference, no decision
    assert feed(g, [(10, 10), (40, 0), (40, 0), (40, 40), (40, 0)]) == ["heuristic", "learned", "learned",
                                                                        "heuristic", "learned"]
    assert g.fallbacks == 1 and g.reference == 1.0


def test_host_restart_starts_a_new_window_without_a_decision():
    g = FallbackGuard(window_s=30, min_requests=20, probe_every=10)
    feed(g, [(40, 38)])
    g.observe(counters(finished=100, met=50), 40.0)
    g.observe(counters(finished=5, met=0), 50.0)      # counters went down: restarted
    g.observe(counters(finished=45, met=10), 75.0)    # 25 s into the new window: not closed
    assert g.windows == 1 and g.fallbacks == 0
    g.observe(counters(finished=45, met=10), 80.0)    # closed: 40 finished, 10 met
    assert g.windows == 2 and g.fallbacks == 1


def test_guard_settings_are_validated():
    for kw in ({"window_s": 0}, {"min_requests": 0}, {"probe_every": 1}, {"cooldown_windows": 0}):
        with pytest.raises(ConfigError, match="fallback guard"):
            FallbackGuard(**kw)


window = st.tuples(st.integers(0, 60), st.floats(0, 1)).map(lambda t: (t[0], int(t[0] * t[1])))


@settings(max_examples=200, deadline=None)
@given(st.lists(window, min_size=1, max_size=40), st.integers(2, 6), st.integers(1, 4))
def test_guard_invariants(windows, probe_every, cooldown):
    """For any history: every fallback is counted and logged with a learned attainment below the
    reference, decided on a learned window with enough requests; the heuristic then holds the next
    ``cooldown`` windows; and the learned policy never runs more than probe_every - 1 windows in a row."""
    g = FallbackGuard(window_s=10, min_requests=20, probe_every=probe_every, cooldown_windows=cooldown)
    active = feed(g, windows)
    again = FallbackGuard(window_s=10, min_requests=20, probe_every=probe_every, cooldown_windows=cooldown)
    assert feed(again, windows) == active and again.events == g.events  # deterministic
    falls = [e for e in g.events if e["kind"] == "fallback"]
    assert g.fallbacks == len(falls)
    for e in falls:
        i = e["window"] - 1
        assert active[i] == "learned" and windows[i][0] >= 20
        assert e["learned_attainment"] < e["heuristic_attainment"]
        assert all(a == "heuristic" for a in active[i + 1:i + 1 + cooldown])
    run = longest = 0
    for a in active:
        run = run + 1 if a == "learned" else 0
        longest = max(longest, run)
    assert longest <= probe_every - 1


# ------------------------------------------------------------------------------------------- guarded policy

def test_guarded_policy_delegates_and_feeds_the_tuner():
    learned = LearnedPolicy(tiny_model(seed=6))
    heuristic = FixedBudget(prefill_budget=48, max_running=5)
    tuner = OnlineTuner(learned, n_steps=8, batch_size=8)
    gp = GuardedPolicy(learned, heuristic, FallbackGuard(window_s=1.0, min_requests=1, probe_every=10), tuner)
    obs = observations(12, seed=3)
    on_time = 0
    gp.observe_stats(counters(on_time), 0.0)
    assert gp.act(obs[0]) == ControlAction(48, 5)                 # the probe window: the heuristic
    on_time += 10
    gp.observe_stats(counters(on_time, finished=4, met=4), 1.0)   # closes the probe: reference 1.0
    assert len(tuner._store) == 0                                 # heuristic ticks are not transitions
    for i, o in enumerate(obs[1:6]):
        gp.act(o)
        step = learned.last_step
        assert step.episode_start == (i == 0)                     # the learned policy starts afresh
        on_time += 20
        gp.observe_stats(counters(on_time, late=i, finished=4, met=4), 1.2 + 0.1 * i)
        t = tuner._store[-1]
        assert t.step is step and t.reward == pytest.approx((20 - 32 * (i > 0)) / 100)
    assert len(tuner._store) == 5 and gp.guard.active == "learned"
