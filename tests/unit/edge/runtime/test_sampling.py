"""Token choice (edge/runtime/sampling.py): greedy, and temperature / nucleus sampling drawing from
the distribution they define."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from edge.runtime.sampling import choose_token

P = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(P) + 3.0  # softmax ignores a shift
N = 10_000  # draws per case
ALPHA = 1e-3  # chi-square level; the draws are seeded, so the outcome is fixed, this says how unlucky it may be


def _tempered(t: float) -> np.ndarray:
    """softmax(log P / t) = P^(1/t), normalised."""
    q = P ** (1.0 / t)
    return q / q.sum()


def _nucleus(q: np.ndarray, keep: list[int]) -> np.ndarray:
    out = np.zeros_like(q)
    out[keep] = q[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_p,expected", [
    (1.0, 1.0, P),
    (0.5, 1.0, _tempered(0.5)),
    (2.0, 1.0, _tempered(2.0)),
    # P: 0.4 < 0.6 <= 0.4 + 0.25, so the nucleus is the two most likely tokens
    (1.0, 0.6, _nucleus(P, [0, 1])),
    # P^2 normalised: [.615, .240, .086, ...]; .855 < 0.9 <= .942: three tokens
    (0.5, 0.9, _nucleus(_tempered(0.5), [0, 1, 2])),
    (1.0, 0.3, _nucleus(P, [0])),
], ids=["softmax", "t0.5", "t2", "top_p0.6", "t0.5_top_p0.9", "top_p0.3"])
def test_sampled_frequencies_match_the_distribution(temperature, top_p, expected):
    """Pearson chi-square of N draws against the expected probabilities. Tokens outside the
    nucleus are never drawn (a single one fails). With N = 10000 a wrong temperature or a nucleus
    one token too small or too large moves a cell by tens of standard deviations or more."""
    rng = np.random.default_rng(0)
    counts = np.bincount([choose_token(LOGITS, temperature, top_p, rng) for _ in range(N)], minlength=P.size)
    inside = expected > 0
    assert counts[~inside].sum() == 0, f"drawn outside the nucleus: {counts}"
    if inside.sum() > 1:
        pvalue = stats.chisquare(counts[inside], N * expected[inside]).pvalue
        assert pvalue > ALPHA, f"counts {counts} vs expected {np.round(N * expected)} (p = {pvalue:.2g})"


def test_nucleus_ties_keep_the_lowest_ids():
    """Equal probabilities are ordered by id: the nucleus of three tied tokens at top_p 0.5 is {0, 1}."""
    logits = np.array([0.0, 1.0, 1.0, 1.0])
    rng = np.random.default_rng(1)
    assert {choose_token(logits, 1.0, 0.5, rng) for _ in range(500)} == {1, 2}


def test_greedy():
    logits = np.array([1.0, 3.0, 3.0, -2.0])
    assert choose_token(logits, 0.0, 1.0, np.random.default_rng(0)) == 1  # argmax, lowest id on ties
    assert choose_token(logits, 1.0, 0.5, None) == 1  # no generator: greedy
