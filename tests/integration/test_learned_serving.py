"""The learned scheduler served for real: ``policy=ppo`` on the Ray Serve + Triton stack runs the
shipped recurrent-PPO policy behind its fallback guard, fine-tunes it online from live transitions,
and exports which policy is in control, the fallbacks and the updates in /metrics."""
from __future__ import annotations

import concurrent.futures
import time

import pytest

from tests.integration.test_serving import _start, completion, health, metrics, sample, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(served_run, repository_copy, find_processes, tmp_path_factory, free_port):
    # short windows so that a few seconds of traffic close several: the guard's first window is the
    # heuristic's probe, the learned policy acts after it; 8 learned ticks make one online update. This
    # stack serves through Ray Serve's HTTP proxy (serve.ingress: proxy, what a stack joining a cluster
    # uses); the other stacks of the suite serve by direct ingress, the default
    yield from _start(served_run, repository_copy, find_processes, tmp_path_factory, free_port(), "learned",
                      policy="ppo", ingress="proxy", guard={"window_s": 1.0, "min_requests": 1, "probe_every": 50},
                      tuner={"n_steps": 8, "batch_size": 8, "n_epochs": 1})


def test_the_proxy_ingress_serves_through_serves_proxy(stack, find_listener):
    """serve.ingress proxy: the process listening on the stack's port is Serve's HTTP proxy actor."""
    owner = find_listener(stack.cfg.port)
    assert owner is not None and "ProxyActor" in owner, owner


def test_learned_policy_serves_hands_over_from_its_probe_and_tunes_online(stack):
    status, state = health(stack.url)
    assert status == 200 and state["ready"]
    replica = next(iter(state["replicas"]))
    t_end = time.monotonic() + 8.0
    statuses = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while time.monotonic() < t_end:
            futs = [pool.submit(completion, stack.url, max_tokens=12, temperature=0) for _ in range(4)]
            statuses += [f.result()[0] for f in futs]
    assert statuses and all(s == 200 for s in statuses)

    def state_of() -> dict:
        fams = metrics(stack.url)
        return {"learned": sample(fams, "smartexit_scheduler_active_policy", "smartexit_scheduler_active_policy",
                                  replica=replica, policy="ppo"),
                "updates": sample(fams, "smartexit_scheduler_online_updates",
                                  "smartexit_scheduler_online_updates_total", replica=replica),
                "fallbacks": sample(fams, "smartexit_scheduler_fallbacks", "smartexit_scheduler_fallbacks_total",
                                    replica=replica)}
    wait_for(lambda: state_of()["updates"] >= 1, timeout=30, what="one online update of the learned policy")
    st = state_of()
    # in control now, or handed back to the heuristic by the guard (then counted as a fallback)
    assert st["learned"] == 1.0 or st["fallbacks"] >= 1
    # the policy still sets the knobs: the engine's budget is one of the learned action grid's or AIMD's
    assert sample(metrics(stack.url), "smartexit_prefill_budget_tokens", "smartexit_prefill_budget_tokens",
                  replica=replica) >= 1


def test_a_running_stack_switches_to_another_policy(stack):
    """The scheduler bench compares policies on one stack: the worker's policy is switched in place, the next
    ticks are the new policy's (here a fixed budget the learned grid does not use), and settings outside the
    policy's, or a policy that cannot be built, are refused with the running one kept."""
    from edge.core.errors import ConfigError
    from scheduler.serving.stack import set_policy

    status, state = health(stack.url)
    replica = next(iter(state["replicas"]))
    with pytest.raises(ConfigError, match="set_policy changes only"):
        set_policy({"port": 9})
    with pytest.raises(ConfigError):
        set_policy({"policy": "ppo", "policy_kwargs": {"path": "/nonexistent/policy"}})
    # the stack's guard and tuner settings are the learned policy's: a switch leaves them at their defaults
    state = set_policy({"policy": "fixed", "policy_kwargs": {"prefill_budget": 40, "max_running": 3}})
    assert state["policy"] == "fixed"
    assert completion(stack.url, max_tokens=4, temperature=0)[0] == 200
    wait_for(lambda: sample(metrics(stack.url), "smartexit_prefill_budget_tokens", "smartexit_prefill_budget_tokens",
                            replica=replica) == 40, timeout=15, what="the fixed budget in force")
    fams = metrics(stack.url)
    assert sample(fams, "smartexit_scheduler_active_policy", "smartexit_scheduler_active_policy", replica=replica,
                  policy="fixed") == 1.0
