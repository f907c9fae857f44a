"""Control policies: the fixed budget holds; AIMD halves on a missed SLA and grows while comfortable."""
from __future__ import annotations

import pytest

from edge.core.errors import ConfigError
from scheduler.control.policies import AIMD, ControlObservation, FixedBudget, observation_from_stats
from scheduler.control.registry import make_policy

STATS = {"waiting": 3, "prefill_backlog_tokens": 200, "running": 4, "free_slots": 12, "prefill_budget": 128,
         "max_running": 8, "max_seqs": 16, "num_layers": 12, "predicted_exit_layer": 9.5, "min_slack_ms": 50.0,
         "sla_ttft_ms": 1000.0, "sla_tpot_ms": 100.0, "max_chunk": None}


def _obs(**kw) -> ControlObservation:
    return observation_from_stats({**STATS, **kw})


def test_observation_reads_the_host_stats_and_names_a_missing_key():
    obs = _obs()
    assert obs.prefill_budget == 128 and obs.predicted_exit_layer == 9.5 and obs.min_slack_ms == 50.0
    assert _obs(min_slack_ms=None).min_slack_ms is None
    with pytest.raises(ConfigError, match="'free_slots'"):
        observation_from_stats({k: v for k, v in STATS.items() if k != "free_slots"})


def test_fixed_budget_is_constant_and_capped_by_slots():
    p = make_policy("fixed", prefill_budget=64, max_running=32)
    for slack in (-100.0, 0.0, 500.0):
        a = p.act(_obs(min_slack_ms=slack))
        assert (a.prefill_budget, a.max_running) == (64, 16)


def test_aimd_decreases_multiplicatively_when_behind_and_increases_additively_when_ahead():
    p = AIMD(step_tokens=32, decrease=0.5, margin_ms=20, min_budget=16, max_budget=256)
    a = p.act(_obs(min_slack_ms=-5.0))
    assert (a.prefill_budget, a.max_running) == (64, 7)
    a = p.act(_obs(min_slack_ms=50.0))
    assert (a.prefill_budget, a.max_running) == (160, 9)
    # comfortable but nothing waiting: hold
    a = p.act(_obs(min_slack_ms=50.0, waiting=0, prefill_backlog_tokens=0))
    assert (a.prefill_budget, a.max_running) == (128, 8)
    # inside the margin: hold
    assert p.act(_obs(min_slack_ms=10.0)).prefill_budget == 128
    # floors and ceilings
    assert p.act(_obs(min_slack_ms=-1.0, prefill_budget=20, max_running=1)) .prefill_budget == 16
    assert p.act(_obs(min_slack_ms=-1.0, prefill_budget=20, max_running=1)).max_running == 1
    assert p.act(_obs(prefill_budget=250, max_running=16)).prefill_budget == 256
    assert p.act(_obs(prefill_budget=250, max_running=16)).max_running == 16


def test_aimd_converges_under_a_toy_latency_model():
    """Slack falls linearly with the budget (a longer step per prompt token): AIMD oscillates around
    the budget where slack crosses zero, never sitting far below it (the sawtooth of AIMD)."""
    p, budget, limit, seen = AIMD(step_tokens=16), 16, 4, []
    for _ in range(200):
        slack = 100.0 - 0.5 * budget  # zero at 200 tokens
        a = p.act(_obs(prefill_budget=budget, max_running=limit, min_slack_ms=slack))
        budget, limit = a.prefill_budget, a.max_running
        seen.append(budget)
    tail = seen[100:]
    assert max(tail) <= 240 and min(tail) >= 90 and 120 < sum(tail) / len(tail) < 220


@pytest.mark.parametrize("name,kw,msg", [("sarathi", {}, "unknown policy"), ("aimd", {"decrease": 1.5}, "decrease"),
                                         ("fixed", {"prefill_budget": 0}, ">= 1"), ("aimd", {"nope": 1}, "nope")])
def test_bad_policy_settings(name, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        make_policy(name, **kw)


def test_maxdelay_trickles_until_the_queue_is_long_or_old_enough():
    from scheduler.control.policies import MaxDelay

    base = dict(waiting=1, prefill_backlog_tokens=100, running=2, free_slots=14, prefill_budget=16, max_running=16,
                max_seqs=16, num_layers=12, predicted_exit_layer=12.0, min_slack_ms=50.0, sla_ttft_ms=500.0)
    p = MaxDelay(max_delay_ms=100, preferred_tokens=256, min_budget=16, max_budget=512)
    # waited 50 ms (slack 450 of 500), 100 tokens queued: trickle
    assert p.act(ControlObservation(**base, oldest_waiting_slack_ms=450.0)).prefill_budget == 16
    # waited 150 ms: release
    assert p.act(ControlObservation(**base, oldest_waiting_slack_ms=350.0)).prefill_budget == 512
    # enough tokens queued: release at once
    assert p.act(ControlObservation(**{**base, "prefill_backlog_tokens": 300}, oldest_waiting_slack_ms=490.0)
                 ).prefill_budget == 512
    assert p.act(ControlObservation(**{**base, "max_seqs": 4}, oldest_waiting_slack_ms=None)).max_running == 4
