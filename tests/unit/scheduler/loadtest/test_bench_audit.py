"""bench audit's traffics side by side (scheduler/loadtest/bench_audit.py ``audit_runs``): how many processes it
takes. Each holds a copy of the model, so a backend other than the default CPU one ($SMARTEXIT_BACKEND_CONFIG: a
GPU's engines, sized for one copy) serves them one at a time here, as does ``workers=1``; a negative count is
refused. That processes give what one after the other gives: tests/integration/test_bundle_backends.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from edge.core.errors import ConfigError
from edge.runtime.served import BACKEND_ENV
from scheduler.loadtest import bench_audit
from scheduler.loadtest.bench_audit import AuditJob, BenchAuditConfig, audit_runs


@pytest.fixture
def served_here(monkeypatch):
    """audit_run replaced by a recorder: it only runs in this process (a spawned worker would run the real one)."""
    calls = []

    def record(bundle, prompts, cfg, tag, as_served=False, rule_edit=None):
        calls.append(tag)
        return {"tag": tag, "prompts": len(prompts), "as_served": as_served}

    monkeypatch.setattr(bench_audit, "audit_run", record)
    return calls


JOBS = {"long": AuditJob([[1, 2]] * 3, "a"), "served": AuditJob([[3]], "b", as_served=True)}


def test_another_backend_serves_the_traffics_in_turn_here(served_here, monkeypatch, tmp_path):
    monkeypatch.setenv(BACKEND_ENV, str(tmp_path / "backend.json"))
    out = audit_runs(Path("bundle"), JOBS, BenchAuditConfig())
    assert served_here == ["a", "b"]
    assert out == {"long": {"tag": "a", "prompts": 3, "as_served": False},
                   "served": {"tag": "b", "prompts": 1, "as_served": True}}


def test_one_worker_serves_them_in_turn_and_a_negative_count_is_refused(served_here, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert list(audit_runs(Path("bundle"), JOBS, BenchAuditConfig(), workers=1)) == ["long", "served"]
    assert served_here == ["a", "b"]
    with pytest.raises(ConfigError, match="workers >= 0"):
        BenchAuditConfig(workers=-1)
