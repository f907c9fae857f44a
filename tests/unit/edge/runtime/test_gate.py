"""The step gate (edge/runtime/gate.py): exits run only at batch sizes where checking steps measured cheaper
than full-depth steps; the served engine has it, a batch run does not."""
from __future__ import annotations

import pytest

from edge.runtime.batch import run_batch
from edge.runtime.engine import Engine, held_step_gate
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.gate import StepGate
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import _model, _prompts, _run


def _measured(gate: StepGate, b: int, checking: float, full: float) -> StepGate:
    for _ in range(2):  # the first observation of a kind is not counted (it builds the bindings)
        gate.observe(b, True, checking)
        gate.observe(b, False, full)
    return gate


def test_the_gate_tries_both_kinds_then_keeps_the_cheaper_and_retries_the_other():
    g = StepGate()
    assert g.checks(1) and g.estimate(1, True) is None
    g.observe(1, True, 5.0)  # the first of its kind: building bindings, not counted
    assert g.estimate(1, True) is None and g.checks(1)
    g.observe(1, True, 2.0)
    assert g.estimate(1, True) == 2.0
    assert not g.checks(1)  # full depth untried: tried next
    g.observe(1, False, 9.0)
    g.observe(1, False, 1.0)
    period = StepGate.RETRY + StepGate.BURST - 1
    picks = [g.checks(1) for _ in range(2 * period)]
    # full depth measured cheaper: it runs, and checking is tried BURST steps in a row every RETRY steps
    first = StepGate.RETRY - 1
    assert picks.count(True) == 2 * StepGate.BURST
    assert all(picks[first:first + StepGate.BURST]) and all(picks[first + period:first + period + StepGate.BURST])
    # each batch size has its own measurements: batch 4 is untried
    assert g.checks(4) and g.estimate(4, False) is None
    assert g.share_checked(1) == pytest.approx((2 + 2 * StepGate.BURST) / (2 * period + 3))
    assert g.share_checked(7) is None


def test_a_retry_does_not_count_the_cold_first_step_of_either_kind():
    """After the other kind ran, a kind's first step pays for caches the other evicted: neither the first step
    of a retry burst nor the first step back counts."""
    g = _measured(StepGate(), 1, 2.0, 1.0)  # checking dearer
    picks = [g.checks(1) for _ in range(StepGate.RETRY - 1)]
    assert not any(picks) and g.checks(1)  # the retry burst starts
    g.observe(1, True, 50.0)  # cold: not counted
    assert g.estimate(1, True) == 2.0
    for _ in range(StepGate.BURST - 1):
        g.observe(1, True, 0.5)
        g.checks(1)
    assert g.estimate(1, True) < 2.0
    # the burst over, the next pick is the kind now cheaper, and its first step is not counted
    assert g.checks(1) is (g.estimate(1, True) <= g.estimate(1, False))
    before = g.estimate(1, False)
    g.observe(1, False, 50.0)
    assert g.estimate(1, False) == before


def test_an_outlier_moves_the_estimate_by_at_most_its_capped_share():
    g = _measured(StepGate(), 1, 1.0, 1.0)
    g.observe(1, True, 1000.0)  # a GC pause
    assert g.estimate(1, True) == pytest.approx(1.0 + StepGate.ALPHA * (StepGate.OUTLIER - 1.0))
    assert g.checks(1) is False  # checking now measures dearer than full depth (1.2 > 1.0)


@pytest.mark.parametrize("checking_cheaper", [True, False])
def test_the_served_engine_checks_only_where_checking_measured_cheaper(checking_cheaper):
    """With checking measured dearer, a bounded request gets the full model's tokens, every one at the last
    layer; measured cheaper, its tokens exit as the rule says. The steps the engine ran are measured."""
    m, prompts = _model(), _prompts(1, seed=41)
    rule = ConfidenceRule(0.0)  # exit at the first exit whenever allowed
    backend = TorchBackend(m)
    eng = Engine(backend, EngineConfig(max_seqs=1, max_len=128, kv_mode=KVMode.PROPAGATE, exit_gate=True), rule)
    _measured(eng.step_gate, 1, 1e-6 if checking_cheaper else 100.0, 100.0 if checking_cheaper else 1e-6)
    got = _run(eng, prompts)[0]
    full = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128)), prompts)[0]
    alone = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128, kv_mode=KVMode.PROPAGATE), rule),
                 prompts)[0]
    first, last = m.exit_layers[0], m.exit_layers[-1]
    assert all(e == first for _, e in alone[1:])  # ungated, this rule exits every decoded token
    if checking_cheaper:
        assert got == alone
        assert eng.step_gate.estimate(1, True) < 1.0  # moved toward what the checking steps took
        assert eng.step_gate.share_checked(1) == 1.0
    else:
        assert got == full and all(e == last for _, e in got)
        assert eng.step_gate.estimate(1, False) < 1.0  # moved toward what the full-depth steps took
        assert eng.step_gate.share_checked(1) == 0.0


def test_gates_are_kept_by_the_backend_per_rule_and_kv_mode_and_off_in_batch_runs():
    m = _model()
    backend = TorchBackend(m)
    rule, other = ConfidenceRule(0.0), ConfidenceRule(0.5)
    cfg = dict(max_seqs=1, max_len=128, exit_gate=True)
    assert held_step_gate(backend, KVMode.DEFER, rule) is None
    a = Engine(backend, EngineConfig(kv_mode=KVMode.DEFER, **cfg), rule).step_gate
    assert held_step_gate(backend, KVMode.DEFER, rule) is a  # what the benches read its shares from
    assert Engine(backend, EngineConfig(kv_mode=KVMode.DEFER, **cfg), rule).step_gate is a  # what it measured
    assert Engine(backend, EngineConfig(kv_mode=KVMode.PROPAGATE, **cfg), rule).step_gate is not a
    assert Engine(backend, EngineConfig(kv_mode=KVMode.DEFER, **cfg), other).step_gate is not a
    assert Engine(backend, EngineConfig(max_seqs=1, max_len=128), rule).step_gate is None  # off by default
    # a batch run does what its rule says (calibration, the benches' exit systems): every decoded token exits
    res = run_batch(backend, rule, _prompts(1, seed=43), 6, KVMode.PROPAGATE)
    assert all(e == m.exit_layers[0] for e in res.exit_layers[0][1:])


def test_the_served_engine_config_turns_the_gate_on():
    from exporters.triton import RepoConfig

    assert RepoConfig().host_config(512).engine.exit_gate is True
    assert RepoConfig(exit_gate=False).host_config(512).engine.exit_gate is False
    assert EngineConfig().exit_gate is False
    assert RepoConfig().host_config(512).engine.bounded_drafts is True  # bounded requests draft where it pays
    assert RepoConfig(bounded_drafts=False).host_config(512).engine.bounded_drafts is False
    assert EngineConfig().bounded_drafts is False
