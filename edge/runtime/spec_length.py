"""How many tokens mode exact drafts: the lookup and corpus drafts' counted acceptance
(:class:`LookupAcceptance`) and the length it chooses against measured call costs (:func:`lookup_length`), and
an exit draft's stop rules (:func:`include_next`: ``fixed``, ``top1``, ``calibrated``); the algorithm is in
edge/runtime/speculative.py."""
from __future__ import annotations

import numpy as np

from edge.runtime.spec_costs import CallCosts, DraftCosts
from edge.runtime.speculative import SpecConfig, StopRule


class LookupAcceptance:
    """How often lookup draft j (1-based) is the full model's token, given drafts 1..j-1 were, after a
    suffix match of length n: counts as the engine verifies, with one success and one failure as the
    prior (a row that never drafted starts at 1/2)."""

    def __init__(self, max_n: int, max_draft: int) -> None:
        self.hits = np.ones((max_n + 1, max_draft))
        self.tries = np.full((max_n + 1, max_draft), 2.0)

    def probs(self, n: int, k: int) -> np.ndarray:
        return self.hits[n, :k] / self.tries[n, :k]

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """A round of ``drafted`` drafts after a match of length n, the first ``accepted`` accepted:
        drafts 1..accepted hit, draft accepted + 1 (if any) missed, the rest were never judged."""
        judged = min(accepted + 1, drafted)
        self.tries[n, :judged] += 1
        self.hits[n, :accepted] += 1



def lookup_length(probs: np.ndarray, costs: CallCosts, plain: float) -> tuple[int, float]:
    """(k, value): the number of drafts 0..len(probs) whose round has the most expected tokens per
    second, E(k) / C(1, k + 1), and that value; k = 0 (no speculation) unless it beats ``plain``, the
    row's tokens per second on a plain step."""
    best, value = 0, plain
    expected, prefix = 1.0, 1.0
    for k in range(1, len(probs) + 1):
        prefix *= float(probs[k - 1])
        expected += prefix
        v = expected / costs.cost(1, k + 1)
        if v > value:
            best, value = k, v
    return best, value



def include_next(rule: SpecConfig, drafts: int, probs: list[float], top1: float, costs: DraftCosts) -> bool:
    """Whether draft token ``drafts + 1`` (just drafted, ``probs`` the calibrated agreement of drafts
    1..drafts+1, ``top1`` its top-1 probability) joins the verification."""
    if drafts >= rule.max_draft:
        return False
    if rule.stop is StopRule.FIXED:
        return drafts < rule.fixed
    if rule.stop is StopRule.TOP1:
        return top1 >= rule.top1
    prefix = np.cumprod(probs)  # P(drafts 1..n all accepted), n = 1..drafts+1
    expected = 1.0 + float(prefix[:drafts].sum())
    now, more = costs.round(drafts), costs.round(drafts + 1)
    return float(prefix[drafts]) * now > expected * (more - now)
