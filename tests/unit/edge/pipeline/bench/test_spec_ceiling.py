"""The self-speculation ceiling: rounds simulated from an agreement trace and given costs."""
from __future__ import annotations

import numpy as np
import pytest

from edge.pipeline.bench.spec_ceiling import AgreementTrace, SpecCosts, ceiling, simulate, stop_rules
from edge.runtime.speculative import SpecConfig

COSTS = SpecCosts(draft_step=0.5, draft_step_no_head=0.4, verify={m: 1.2 + 0.05 * (m - 1) for m in range(1, 8)},
                  full_step=1.6)


def _trace(agree, p=None, top1=None, lengths=None):
    a = np.asarray(agree, bool)
    p = np.full(a.shape, 0.5) if p is None else np.asarray(p, float)
    top1 = np.full(a.shape, 0.5) if top1 is None else np.asarray(top1, float)
    return AgreementTrace(a, p, top1, lengths or [a.size])


def test_oracle_on_a_trace_that_always_agrees_is_the_perfect_draft_ceiling():
    spec = SpecConfig(max_draft=6)
    tr = _trace([True] * 70)  # ten rounds of 6 accepted drafts + the full model's token
    out = ceiling(tr, COSTS, spec)
    per_round = 6 * COSTS.draft_step + COSTS.draft_step_no_head + COSTS.verify[7]
    assert out["rules"]["oracle"]["speedup_vs_full"] == pytest.approx(COSTS.full_step * 70 / (10 * per_round))
    assert out["perfect_draft_ceiling"] == pytest.approx(COSTS.full_step * 7 / per_round)
    assert out["rules"]["oracle"]["acceptance_rate"] == 1.0


def test_rounds_end_at_the_first_disagreement():
    # fixed 3 on agree = [1, 0, ...]: round 1 drafts 3, accepts 1, emits 2 tokens
    tr = _trace([True, False, True, True, True, True], lengths=[6])
    stop, cap = stop_rules(COSTS, SpecConfig(max_draft=6))["fixed_3"]
    assert cap == 3
    r = simulate(tr, COSTS, stop, max_draft=cap)
    # rounds: t=0 drafts 3 accepts 1 (2 tokens); t=2 drafts 3 (positions 2..4) accepts 3 (4 tokens)
    assert r["tokens_per_round"] == pytest.approx(3.0)
    assert r["acceptance_rate"] == pytest.approx(4 / 6)


def test_oracle_never_loses_to_another_rule_and_never_drafts_a_rejected_token():
    rng = np.random.default_rng(0)
    a = rng.random(400) < 0.6
    p = np.clip(a * 0.3 + rng.random(400) * 0.7, 0, 1)
    out = ceiling(_trace(a, p, p, [100] * 4), COSTS, SpecConfig())
    best = max(v["speedup_vs_full"] for k, v in out["rules"].items() if k != "oracle")
    assert out["oracle_ceiling"] >= best
    assert out["rules"]["oracle"]["acceptance_rate"] == 1.0
    assert out["best_fixed"].startswith("fixed_") and out["best_top1"].startswith("top1_")


def test_calibrated_rule_drafts_while_agreement_is_likely():
    rules = stop_rules(COSTS, SpecConfig(max_draft=6))
    sure, unsure = _trace([True] * 30, p=[0.99] * 30), _trace([False] * 30, p=[0.01] * 30)
    assert simulate(sure, COSTS, *rules["calibrated"])["tokens_per_round"] > 5
    assert simulate(unsure, COSTS, *rules["calibrated"])["tokens_per_round"] == 1.0


def test_a_shortlist_model_is_refused_with_a_reason():
    """The ceiling records host-side decision inputs; a shortlist model decides in its graphs (issue 27)."""
    from edge.core.errors import ConfigError
    from edge.pipeline.bench.spec_ceiling import agreement_trace
    from edge.runtime.torch_backend import TorchBackend
    from tests.unit.edge.runtime.test_candidates import _model

    with pytest.raises(ConfigError, match="candidate shortlist"):
        agreement_trace(TorchBackend(_model()), None, [[1, 2, 3]], 4, 1)
