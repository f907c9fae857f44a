"""Risk control over units: the cascade, per-unit false-exit counts, and the Learn-then-Test
guarantee on synthetic data whose true false-exit rate is known exactly."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from calibration.cascade import cascade, cascade_risk, false_exit_counts, unit_false_exit_counts
from calibration.plots import exit_depth_histogram
from calibration.pvalues import PValue
from calibration.risk import NEVER_EXIT, default_grid, learn_then_test
from edge.core.errors import ConfigError
from tests.images import assert_png, figure_size

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


@pytest.mark.parametrize("seed", range(3))
def test_unit_counts_sum_to_the_token_counts_and_match_the_cascade(seed):
    rng = np.random.default_rng(seed)
    n, units = 400, 37
    levels = np.round(np.linspace(0, 1, 11), 10)
    probs = {k: rng.choice(levels, n) for k in (2, 5)}
    correct = {k: rng.integers(0, 2, n) for k in probs}
    unit = rng.integers(0, units, n)
    lams = rng.permutation(np.concatenate([levels, rng.uniform(-0.1, 1.1, 20)]))
    per_unit = unit_false_exit_counts(probs, correct, unit, units, lams, final_layer=9)
    np.testing.assert_array_equal(per_unit.sum(axis=0), false_exit_counts(probs, correct, lams, 9))
    for j in (0, 7, 20):
        exit_at = cascade(probs, lams[j], 9)
        idx = {2: 0, 5: 1}
        false = np.array([exit_at[i] < 9 and not correct[exit_at[i]][i] if exit_at[i] in idx else False
                          for i in range(n)])
        np.testing.assert_array_equal(per_unit[:, j], np.bincount(unit[false], minlength=units))
    with pytest.raises(ConfigError, match=r"unit ids must be in \[0, 37\)"):
        unit_false_exit_counts(probs, correct, unit + 1, units, lams, 9)


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


def _coverage(method: PValue, eps: float, delta: float, units: int, per_unit: int, reps: int,
              seed: int) -> np.ndarray:
    """LTT on ``reps`` fresh sets of ``units`` units of ``per_unit`` i.i.d. tokens; the chosen lams.
    Every unit has the same expected loss R(lam), so the mean per-unit rate has mean R(lam)."""
    P, Y = _synthetic(np.random.default_rng(seed), reps, units * per_unit)
    grid = np.linspace(1.0, 0.0, 201)
    unit = np.repeat(np.arange(units), per_unit)
    chosen = np.empty(reps)
    for r in range(reps):
        probs, correct = {4: P[r, 0], 8: P[r, 1]}, {4: Y[r, 0], 8: Y[r, 1]}
        losses = unit_false_exit_counts(probs, correct, unit, units, grid, 12) / per_unit
        chosen[r] = learn_then_test(losses, grid, eps, delta, method, seed=r).lam
    return chosen


def _allowance(delta: float, reps: int) -> float:
    return delta + 3 * math.sqrt(delta * (1 - delta) / reps)


@pytest.mark.parametrize("method", [PValue.BETTING, PValue.HOEFFDING_BENTKUS])
def test_learn_then_test_controls_the_true_false_exit_rate(method):
    eps, delta, reps = 0.05, 0.1, 100
    chosen = _coverage(method, eps, delta, units=400, per_unit=5, reps=reps, seed=1)
    assert np.mean(true_risk(chosen) > eps) <= _allowance(delta, reps)
    assert np.all(chosen < 0.95)  # not vacuous: tokens do exit
    assert np.mean(true_risk(chosen)) > 0.3 * eps  # and the threshold is not absurdly strict


def test_walk_fields_and_stops_at_the_first_failure():
    P, Y = _synthetic(np.random.default_rng(5), 1, 3000)
    probs, correct = {4: P[0, 0], 8: P[0, 1]}, {4: Y[0, 0], 8: Y[0, 1]}
    grid = default_grid(201)
    losses = unit_false_exit_counts(probs, correct, np.arange(3000) // 3, 1000, grid, 12) / 3
    w = learn_then_test(losses, grid, epsilon=0.05, delta=0.1, method="betting", seed=0)
    assert w.certified and not w.completed and w.n_units == 1000 and w.method is PValue.BETTING
    assert all(pv <= 0.1 for _, _, pv in w.tested[:-1]) and w.tested[-1][2] > 0.1
    assert w.lam == w.tested[-2][0] == grid[w.index]
    assert w.tested[w.index][1] == pytest.approx(losses[:, w.index].mean())
    json.dumps(w.to_dict())
    done = learn_then_test(losses[:, :w.index + 1], grid[:w.index + 1], 0.05, 0.1, "betting", 0)
    assert done.completed and done.lam == w.lam


def test_learn_then_test_never_exits_when_even_the_strictest_threshold_fails():
    w = learn_then_test(np.ones((400, 3)), np.array([1.0, 0.5, 0.0]), 0.009)
    assert w.lam == NEVER_EXIT and not w.certified and not w.completed
    assert len(w.tested) == 1 and w.tested[0][0] == 1.0


def test_learn_then_test_errors():
    grid = np.array([1.0, 0.5])
    ok = np.zeros((400, 2))
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=rf"epsilon must be in \(0, 1\), got {bad}"):
            learn_then_test(ok, grid, epsilon=bad)
        with pytest.raises(ConfigError, match=rf"delta must be in \(0, 1\), got {bad}"):
            learn_then_test(ok, grid, 0.009, delta=bad)
    with pytest.raises(ConfigError, match="need at least 369 units.*got|need at least 369 units"):
        learn_then_test(ok[:300], grid, 0.009)
    with pytest.raises(ConfigError, match="strictly decreasing"):
        learn_then_test(ok, grid[::-1], 0.009)
    with pytest.raises(ConfigError, match=r"losses must be \[U, G=2\]"):
        learn_then_test(ok[:, :1], grid, 0.009)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        learn_then_test(ok + 2, grid, 0.009)


def test_exit_depth_histogram_draws_its_bars(tmp_path):
    """Groups of bars in matplotlib's cycle colours, heights in proportion to the fractions. The
    figure is 6 x 4 inches at 100 dpi (calibration/plots.py)."""
    blue, orange = "#1f77b4", "#ff7f0e"
    out = exit_depth_histogram({"isotonic": {3: 0.2, 6: 0.3, 12: 0.5}, "maxprob": {3: 0.1, 12: 0.9}},
                               tmp_path / "depth.png", "test")
    assert_png(out, figure_size(6, 4, 100), colours=[blue, orange])
    single = assert_png(exit_depth_histogram({3: 0.2, 6: 0.3, 12: 0.5}, tmp_path / "one.png"), figure_size(6, 4, 100),
                        colours=[blue])  # one group: no legend over the bars
    heights = _bar_heights(single, blue)
    assert heights / heights[0] == pytest.approx([1.0, 1.5, 2.5], rel=0.03)


def _bar_heights(img: np.ndarray, colour: str) -> np.ndarray:
    """Pixel heights of the bars of one solid colour, left to right."""
    want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    cols = (img == want).all(-1).sum(0)  # [W]
    edges = np.flatnonzero(np.diff(np.r_[0, cols > 0, 0]))  # starts and ends of runs of columns
    return np.array([cols[a:b].max() for a, b in zip(edges[::2], edges[1::2])], float)
