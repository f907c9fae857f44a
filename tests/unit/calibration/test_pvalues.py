"""p-values for the mean of [0, 1]-bounded unit losses: validity on distributions whose mean is known,
known values, bounds, and why the unit (not the token) must be the sample."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from calibration.pvalues import (PValue, exceeds_pvalue, min_units, pvalues, upper_confidence_bound)
from edge.core.errors import ConfigError

VALID_FOR_RATES = [PValue.BETTING, PValue.HOEFFDING_BENTKUS, PValue.HOEFFDING]


def _allowance(delta: float, reps: int) -> float:
    """delta plus three binomial standard deviations of a rejection rate over ``reps`` trials."""
    return delta + 3 * math.sqrt(delta * (1 - delta) / reps)


def _rates(rng, dist: str, mean: float, n: int, reps: int) -> np.ndarray:
    """[n, reps] unit losses in [0, 1] with the given mean."""
    if dist == "bernoulli":  # all the mass at the ends: the worst case for a [0, 1] mean
        return (rng.uniform(size=(n, reps)) < mean).astype(float)
    if dist == "prompt_rates":  # per-prompt rates: 31 tokens, prompt-level rate ~ Beta (overdispersed)
        r = rng.beta(0.5, 0.5 * (1 - mean) / mean, size=(n, reps))
        return rng.binomial(31, r) / 31
    if dist == "beta":
        return rng.beta(2.0, 2.0 * (1 - mean) / mean, size=(n, reps))
    raise AssertionError(dist)


@pytest.mark.parametrize("method", VALID_FOR_RATES)
@pytest.mark.parametrize("dist", ["bernoulli", "prompt_rates", "beta"])
def test_type_one_error_at_the_boundary(method, dist):
    """Mean exactly eps (the least favourable null): rejected with probability <= delta."""
    eps, delta, n, reps = 0.02, 0.1, 500, 400
    x = _rates(np.random.default_rng(hash((method.value, dist)) % 2**32), dist, eps, n, reps)
    p = pvalues(x, eps, method, seed=1)  # every column is an independent sample
    assert np.mean(p <= delta) <= _allowance(delta, reps)


def test_betting_has_power_where_hoeffding_bentkus_has_little():
    """Per-prompt rates have far less variance than Bernoulli losses: betting uses that."""
    rng = np.random.default_rng(0)
    x = _rates(rng, "prompt_rates", 0.004, 800, 100)
    p_bet = pvalues(x, 0.009, PValue.BETTING, seed=0)
    p_hb = pvalues(x, 0.009, PValue.HOEFFDING_BENTKUS)
    assert np.mean(p_bet <= 0.05) > 0.9
    assert np.mean(p_hb <= 0.05) < 0.2


def test_a_token_level_bound_over_correlated_tokens_is_invalid():
    """Tokens of one prompt share its rate. Treating the n * T tokens as independent (a binomial over
    tokens, what calibration did before) rejects a true null far more often than delta; the same data
    tested with the prompt as the unit does not."""
    rng = np.random.default_rng(3)
    eps, delta, n, t, reps = 0.05, 0.05, 200, 50, 400
    mean = 1.02 * eps  # the null is true: the mean rate is above eps
    r = rng.beta(0.3, 0.3 * (1 - mean) / mean, size=(n, reps))  # per-prompt rates, overdispersed
    k = rng.binomial(t, r)  # [n, reps] false exits per prompt
    token_p = binom.cdf(k.sum(axis=0), n * t, eps)
    unit_p = pvalues(k / t, eps, PValue.BETTING, seed=0)
    assert np.mean(token_p <= delta) > 0.15
    assert np.mean(unit_p <= delta) <= _allowance(delta, reps)


def test_known_values():
    assert pvalues(np.zeros(100), 0.01, "binomial")[0] == pytest.approx(0.99 ** 100, rel=1e-12)
    x = np.r_[np.ones(7), np.zeros(93)]
    assert pvalues(x, 0.05, "binomial")[0] == pytest.approx(binom.cdf(7, 100, 0.05), rel=1e-12)
    assert pvalues(np.full(100, 0.05), 0.1, "hoeffding")[0] == pytest.approx(math.exp(-0.5))
    assert pvalues(np.full(100, 0.2), 0.1, "hoeffding")[0] == 1.0
    assert pvalues(np.zeros(332), 0.009, "hoeffding_bentkus")[0] == pytest.approx(0.991 ** 332, rel=1e-12)
    # betting at zero losses: every bet is the cap 0.9 / (1 - eps), the capital grows by 1 + cap * eps
    eps = 0.009
    cap = 0.9 / (1 - eps)
    assert pvalues(np.zeros(50), eps)[0] == pytest.approx((1 + cap * eps) ** -50, rel=1e-9)


def test_betting_uses_only_the_past_and_order_matters():
    x = np.r_[np.zeros(400), np.full(5, 1.0)]
    # in the order given, the capital peaks before the bad units arrive: Ville allows the maximum
    assert pvalues(x, 0.009, seed=None)[0] == pytest.approx(pvalues(x[:400], 0.009, seed=None)[0])
    assert pvalues(x[::-1], 0.009, seed=None)[0] > pvalues(x, 0.009, seed=None)[0]
    # seeded shuffles are reproducible
    assert pvalues(x, 0.009, seed=4)[0] == pvalues(x, 0.009, seed=4)[0]


@pytest.mark.parametrize("method", list(PValue))
@pytest.mark.parametrize("eps,delta", [(0.009, 0.05), (0.05, 0.1), (0.2, 0.2)])
def test_min_units_matches_its_definition(method, eps, delta):
    n = min_units(eps, delta, method)
    assert pvalues(np.zeros(n), eps, method)[0] <= delta
    assert pvalues(np.zeros(n - 1), eps, method)[0] > delta


def test_min_units_known_values():
    assert min_units(0.009, 0.05, "binomial") == 332  # ceil(log 0.05 / log 0.991)
    assert min_units(0.009, 0.05, "hoeffding_bentkus") == 332
    assert min_units(0.009, 0.05, "hoeffding") == math.ceil(-math.log(0.05) / (2 * 0.009 ** 2))
    cap = 0.9 / 0.991
    assert min_units(0.009, 0.05, "betting") == math.ceil(math.log(20) / math.log(1 + cap * 0.009))


@pytest.mark.parametrize("method", VALID_FOR_RATES)
def test_upper_confidence_bound_is_where_the_test_starts_passing(method):
    rng = np.random.default_rng(2)
    x = rng.binomial(31, rng.beta(0.5, 100, 1000)) / 31
    b = upper_confidence_bound(x, 0.05, method, seed=0)
    assert x.mean() < b < 1
    assert pvalues(x, b, method, seed=0)[0] <= 0.05
    assert pvalues(x, b - 1e-6, method, seed=0)[0] > 0.05
    assert upper_confidence_bound(np.ones(20), 0.05, method) == 1.0


def test_exceeds_pvalue_detects_a_mean_above_eps():
    rng = np.random.default_rng(5)
    high = rng.binomial(31, rng.beta(0.5, 30, 300)) / 31  # mean about 0.016
    assert exceeds_pvalue(high, 0.009) <= 0.05
    assert exceeds_pvalue(np.zeros(300), 0.009) == 1.0


def test_errors():
    with pytest.raises(ConfigError, match=r"epsilon must be in \(0, 1\)"):
        pvalues(np.zeros(10), 1.5)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        pvalues(np.array([0.1, -0.1]), 0.1)
    with pytest.raises(ConfigError, match="0/1 losses only"):
        pvalues(np.array([0.5, 0.0]), 0.1, "binomial")
    with pytest.raises(ConfigError, match="n >= 1 units"):
        pvalues(np.zeros(0), 0.1)
    with pytest.raises(ConfigError, match="unknown p-value method 'bonferroni'"):
        min_units(0.01, 0.05, "bonferroni")
    with pytest.raises(ConfigError, match=r"delta must be in \(0, 1\), got 0"):
        min_units(0.01, 0)
