"""The worker's policy: heuristics by name, the shipped learned policy behind its guard, and a
missing or altered learned policy refused with the reason (before any server starts)."""
from __future__ import annotations

import shutil

import pytest

from edge.core.errors import ConfigError
from scheduler.control.learned import DEFAULT_DIR
from scheduler.serving.config import ServeConfig
from scheduler.serving.engine_host import build_policy


def test_heuristics_by_name_and_the_guarded_learned_policy():
    assert build_policy(ServeConfig(policy="aimd")).name == "aimd"
    assert build_policy(ServeConfig(policy="maxdelay")).name == "maxdelay"
    p = build_policy(ServeConfig(policy="ppo", tuner={"n_steps": 8, "batch_size": 8}))
    assert p.learned.name == "ppo" and p.heuristic.name == "aimd" and p.tuner is not None
    assert build_policy(ServeConfig(policy="ppo", online_finetune=False)).tuner is None


def test_missing_altered_or_misconfigured_learned_policy_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        build_policy(ServeConfig(policy="ppo", policy_kwargs={"path": str(tmp_path / "none")}))
    bad = tmp_path / "ppo"
    shutil.copytree(DEFAULT_DIR, bad)
    with (bad / "policy.zip").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ConfigError, match="sha256"):
        build_policy(ServeConfig(policy="ppo", policy_kwargs={"path": str(bad)}))
    with pytest.raises(ConfigError, match="serve.guard / serve.tuner"):
        build_policy(ServeConfig(policy="ppo", guard={"windows": 3}))
