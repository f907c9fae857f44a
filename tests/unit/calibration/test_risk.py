"""Risk control: p-values, bounds, the cascade, and the Learn-then-Test guarantee on synthetic data
whose true false-exit rate is known exactly."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import binom

from calibration.plots import exit_depth_histogram
from calibration.risk import (
    NEVER_EXIT,
    PValue,
    binomial_pvalue,
    cascade,
    cascade_risk,
    false_exit_counts,
    hoeffding_bentkus_pvalue,
    hoeffding_pvalue,
    learn_then_test,
    min_calibration_tokens,
    upper_confidence_bound,
)
from edge.errors import ConfigError

PUBLIC_PVALUE = {PValue.HOEFFDING: hoeffding_pvalue, PValue.BINOMIAL: binomial_pvalue,
                 PValue.HOEFFDING_BENTKUS: hoeffding_bentkus_pvalue}

# ------------------------------------------------------------------ p-values


def test_pvalue_known_values():
    assert binomial_pvalue(0.0, 100, 0.01) == pytest.approx(0.99 ** 100, rel=1e-12)
    assert binomial_pvalue(0.07, 100, 0.05) == pytest.approx(binom.cdf(7, 100, 0.05), rel=1e-12)  # 0.07*100 > 7
    assert hoeffding_pvalue(0.05, 100, 0.1) == pytest.approx(math.exp(-0.5))
    assert hoeffding_pvalue(0.2, 100, 0.1) == 1.0
    assert hoeffding_bentkus_pvalue(0.0, 332, 0.009) == pytest.approx(0.991 ** 332, rel=1e-12)
    assert hoeffding_bentkus_pvalue(0.2, 100, 0.1) == 1.0


def test_hoeffding_bentkus_is_tighter_than_both_parts():
    r = np.arange(0, 51) / 500
    for eps in (0.01, 0.05, 0.1):
        hb = hoeffding_bentkus_pvalue(r, 500, eps)
        assert (hb <= hoeffding_pvalue(r, 500, eps) + 1e-15).all()  # Pinsker: KL >= 2 (a - b)^2
        assert (hb <= math.e * binomial_pvalue(r, 500, eps) + 1e-15).all()
        assert ((hb >= 0) & (hb <= 1)).all()


def test_pvalue_errors():
    with pytest.raises(ConfigError, match=r"epsilon must be in \(0, 1\), got 1.5"):
        binomial_pvalue(0.0, 10, 1.5)
    with pytest.raises(ConfigError, match="positive integer"):
        hoeffding_pvalue(0.0, 0, 0.1)
    with pytest.raises(ConfigError, match=r"empirical risk must be in \[0, 1\]"):
        hoeffding_bentkus_pvalue(-0.1, 10, 0.1)


@pytest.mark.parametrize("method", list(PValue))
def test_upper_confidence_bound_is_the_smallest_passing_eps(method):
    n, delta = 1000, 0.05
    prev = 0.0
    for k in (0, 1, 5, 30):
        ucb = upper_confidence_bound(k, n, delta, method)
        assert k / n <= ucb < 1
        assert PUBLIC_PVALUE[method](k / n, n, ucb) <= delta
        assert PUBLIC_PVALUE[method](k / n, n, ucb - 1e-7) > delta
        assert ucb > prev
        prev = ucb
    assert upper_confidence_bound(n, n, delta, method) == 1.0


def test_binomial_ucb_closed_form_at_zero_errors():
    assert upper_confidence_bound(0, 500, 0.05, "binomial") == pytest.approx(1 - 0.05 ** (1 / 500), abs=1e-10)


@pytest.mark.parametrize("method", list(PValue))
@pytest.mark.parametrize("eps,delta", [(0.009, 0.05), (0.05, 0.1), (0.001, 0.01)])
def test_min_calibration_tokens_matches_its_definition(method, eps, delta):
    n = min_calibration_tokens(eps, delta, method)
    assert PUBLIC_PVALUE[method](0.0, n, eps) <= delta
    assert PUBLIC_PVALUE[method](0.0, n - 1, eps) > delta


def test_min_calibration_tokens_known_values():
    assert min_calibration_tokens(0.009, 0.05, "binomial") == 332  # ceil(log 0.05 / log 0.991)
    # at zero errors HB's Hoeffding-KL term is (1 - eps)^n, the same as the binomial's
    assert min_calibration_tokens(0.009, 0.05, "hoeffding_bentkus") == 332
    assert min_calibration_tokens(0.009, 0.05, "hoeffding") == math.ceil(-math.log(0.05) / (2 * 0.009 ** 2))
    with pytest.raises(ConfigError, match=r"delta must be in \(0, 1\), got 0"):
        min_calibration_tokens(0.01, 0)
    with pytest.raises(ConfigError, match="unknown p-value method 'bonferroni'"):
        min_calibration_tokens(0.01, 0.05, "bonferroni")


# ------------------------------------------------------------------- cascade
PROBS = {1: np.array([0.9, 0.2, 0.6, 0.1]), 2: np.array([0.95, 0.8, 0.3, 0.2])}
CORRECT = {1: np.array([1, 0, 0, 1]), 2: np.array([1, 1, 1, 0])}


def test_cascade_hand_example():
    np.testing.assert_array_equal(cascade(PROBS, 0.5, final_layer=3), [1, 2, 1, 3])
    rate, frac, skipped = cascade_risk(PROBS, CORRECT, 0.5, final_layer=3)
    assert rate == 0.25  # token 2 exits at layer 1 where its token is wrong
    assert frac == {1: 0.5, 2: 0.25, 3: 0.25}
    assert skipped == pytest.approx((2 + 1 + 2 + 0) / 12)
    np.testing.assert_array_equal(cascade(PROBS, 0.85, final_layer=3), [1, 3, 3, 3])
    assert cascade_risk(PROBS, CORRECT, 0.85, 3).false_exit_rate == 0.0
    assert cascade_risk(PROBS, CORRECT, 0.6, 3).false_exit_rate == 0.25  # p >= lam exits (tie)
    assert cascade_risk(PROBS, CORRECT, 0.0, 3).false_exit_rate == 0.5


def test_cascade_errors():
    with pytest.raises(ConfigError, match="not before the final layer 2"):
        cascade(PROBS, 0.5, final_layer=2)
    with pytest.raises(ConfigError, match="exit 2: calibrated probabilities contain NaN"):
        cascade({1: PROBS[1], 2: np.array([0.1, np.nan, 0.2, 0.3])}, 0.5, 3)
    with pytest.raises(ConfigError, match="differ"):
        cascade_risk(PROBS, {1: CORRECT[1]}, 0.5, 3)
    with pytest.raises(ConfigError, match="empty split"):
        cascade({1: np.zeros(0)}, 0.5, 3)


@pytest.mark.parametrize("seed", range(5))
def test_false_exit_counts_match_the_cascade_at_every_threshold(seed):
    rng = np.random.default_rng(seed)
    n, levels = 300, np.round(np.linspace(0, 1, 11), 10)  # few distinct values: many ties with the grid
    probs = {k: rng.choice(levels, n) for k in (2, 5, 7)}
    correct = {k: rng.integers(0, 2, n) for k in probs}
    lams = rng.permutation(np.concatenate([levels, rng.uniform(-0.1, 1.1, 30)]))
    counts = false_exit_counts(probs, correct, lams, final_layer=9)
    expected = [round(cascade_risk(probs, correct, lam, 9).false_exit_rate * n) for lam in lams]
    np.testing.assert_array_equal(counts, expected)


# -------------------------------------------------------------- learn-then-test
def _synthetic(rng: np.random.Generator, reps: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two decision exits, p ~ U(0, 1) and y ~ Bernoulli(p) independently: P [reps, 2, n], Y [reps, 2, n]."""
    P = rng.uniform(size=(reps, 2, n))
    Y = (rng.uniform(size=P.shape) < P).astype(np.int8)
    return P, Y


def true_risk(lam: np.ndarray) -> np.ndarray:
    """Exact R(lam) for :func:`_synthetic`: P(p1 >= lam, y1 = 0) + P(p1 < lam) P(p2 >= lam, y2 = 0),
    with P(p >= lam, y = 0) = int_lam^1 (1 - p) dp = (1 - lam)^2 / 2."""
    lam = np.clip(lam, 0.0, 1.0)
    return (1 - lam) ** 2 / 2 * (1 + lam)


def test_true_risk_formula_matches_monte_carlo():
    P, Y = _synthetic(np.random.default_rng(0), 1, 200_000)
    for lam in (0.0, 0.5, 0.76, 0.9, 1.0):
        mc = cascade_risk({4: P[0, 0], 8: P[0, 1]}, {4: Y[0, 0], 8: Y[0, 1]}, lam, 12).false_exit_rate
        assert mc == pytest.approx(true_risk(lam), abs=4e-3)


def _coverage(method: PValue, eps: float, delta: float, n: int, reps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Run LTT on ``reps`` fresh calibration sets; return the chosen lams and the naive (r_hat <= eps) lams."""
    P, Y = _synthetic(np.random.default_rng(seed), reps, n)
    grid = np.linspace(1.0, 0.0, 501)
    chosen, naive = np.empty(reps), np.empty(reps)
    for r in range(reps):
        probs, correct = {4: P[r, 0], 8: P[r, 1]}, {4: Y[r, 0], 8: Y[r, 1]}
        res = learn_then_test(probs, correct, 12, eps=eps, delta=delta, method=method, grid=grid)
        assert res.bound <= eps or not res.certified
        chosen[r] = res.lam
        r_hat = false_exit_counts(probs, correct, grid, 12) / n
        fails = np.flatnonzero(r_hat > eps)
        naive[r] = grid[fails[0] - 1] if fails.size and fails[0] > 0 else (grid[-1] if not fails.size else NEVER_EXIT)
    return chosen, naive


def _allowance(delta: float, reps: int) -> float:
    return delta + 3 * math.sqrt(delta * (1 - delta) / reps)


@pytest.mark.parametrize("method", list(PValue))
def test_learn_then_test_controls_the_true_false_exit_rate(method):
    eps, delta, reps = 0.05, 0.05, 200
    chosen, naive = _coverage(method, eps, delta, n=2000, reps=reps, seed=1)
    violations = np.mean(true_risk(chosen) > eps)
    assert violations <= _allowance(delta, reps)
    assert np.mean(chosen) < 1.0 and np.all(chosen < 0.95)  # not vacuous: tokens do exit
    assert np.mean(true_risk(chosen)) > 0.3 * eps  # and the threshold is not absurdly strict
    # the test has power: picking lam by the empirical risk alone breaks the guarantee
    assert np.mean(true_risk(naive) > eps) > 0.2


def test_learn_then_test_controls_risk_at_the_default_eps():
    eps, delta, reps = 0.009, 0.05, 100
    chosen, _ = _coverage(PValue.HOEFFDING_BENTKUS, eps, delta, n=5000, reps=reps, seed=2)
    assert np.mean(true_risk(chosen) > eps) <= _allowance(delta, reps)
    assert np.mean(chosen) < 1.0 and np.mean(true_risk(chosen)) > 0.3 * eps


def test_learn_then_test_result_fields():
    P, Y = _synthetic(np.random.default_rng(5), 1, 3000)
    probs, correct = {4: P[0, 0], 8: P[0, 1]}, {4: Y[0, 0], 8: Y[0, 1]}
    res = learn_then_test(probs, correct, 12, eps=0.05, delta=0.1, method="binomial")
    assert res.certified and res.method is PValue.BINOMIAL and res.n == 3000
    assert all(pv <= 0.1 for _, _, pv in res.tested[:-1]) and res.tested[-1][2] > 0.1
    assert res.lam == res.tested[-2][0]
    rate, frac, skipped = cascade_risk(probs, correct, res.lam, 12)
    assert res.empirical_risk == pytest.approx(rate) and res.exit_fraction == frac
    assert res.layers_skipped_frac == pytest.approx(skipped)
    assert res.empirical_risk <= res.bound <= 0.05
    assert res.bound == upper_confidence_bound(round(rate * 3000), 3000, 0.1, "binomial")
    json.dumps(res.to_dict())


def test_learn_then_test_never_exits_when_even_the_strictest_threshold_fails():
    n = 400
    probs, correct = {1: np.ones(n)}, {1: np.zeros(n, dtype=int)}
    res = learn_then_test(probs, correct, 2)
    assert res.lam == NEVER_EXIT and not res.certified
    assert res.exit_fraction == {1: 0.0, 2: 1.0} and res.empirical_risk == 0.0
    assert len(res.tested) == 1 and res.tested[0][0] == 1.0


def test_learn_then_test_errors():
    rng = np.random.default_rng(0)
    probs, correct = {1: rng.uniform(size=400)}, {1: rng.integers(0, 2, 400)}
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=rf"epsilon must be in \(0, 1\), got {bad}"):
            learn_then_test(probs, correct, 2, eps=bad)
        with pytest.raises(ConfigError, match=rf"delta must be in \(0, 1\), got {bad}"):
            learn_then_test(probs, correct, 2, delta=bad)
    small = {1: probs[1][:300]}, {1: correct[1][:300]}
    with pytest.raises(ConfigError, match="need at least 332 tokens.*got 300"):
        learn_then_test(*small, 2)
    with pytest.raises(ConfigError, match="need at least 18493 tokens"):
        learn_then_test(probs, correct, 2, method="hoeffding")
    nan = probs[1].copy()
    nan[7] = np.nan
    with pytest.raises(ConfigError, match="exit 1: calibrated probabilities contain NaN"):
        learn_then_test({1: nan}, correct, 2)
    with pytest.raises(ConfigError, match="grid"):
        learn_then_test(probs, correct, 2, grid=[])


def test_exit_depth_histogram_writes_png(tmp_path):
    out = exit_depth_histogram({"isotonic": {3: 0.2, 6: 0.3, 12: 0.5}, "maxprob": {3: 0.1, 12: 0.9}},
                               tmp_path / "depth.png", "test")
    assert out.read_bytes()[:4] == b"\x89PNG"
    single = exit_depth_histogram({3: 0.2, 12: 0.8}, tmp_path / "one.png")
    assert single.stat().st_size > 0
