"""Calibrators against scikit-learn and known probabilities; calibration metrics on known cases."""
from __future__ import annotations

import json

import numpy as np
import pytest

from calibration.calibrators import Calibrator, CalibratorKind, fit_calibrators
from calibration.metrics import brier_score, expected_calibration_error, reliability_curve
from calibration.plots import reliability_diagram
from tests.images import assert_png
from calibration.signals import SIGNAL_NAMES
from edge.core.errors import ConfigError

F = len(SIGNAL_NAMES)


def _synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """X [n, F] with x0 = top1_prob-like in (0, 1); y ~ Bernoulli(sigmoid(2 z - 1)), z = logit-ish of x0."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, F))
    X[:, 0] = rng.uniform(0, 1, size=n)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-(2 * (4 * X[:, 0] - 2) - 1)))).astype(np.int64)
    return X, y


@pytest.fixture(scope="module")
def train():
    return _synthetic(4000, 0)


@pytest.fixture(scope="module")
def fresh():
    return _synthetic(20000, 1)


def test_platt_is_calibrated_on_fresh_data(train, fresh):
    cal = Calibrator(CalibratorKind.PLATT).fit(*train)
    p = cal.predict(fresh[0])
    assert expected_calibration_error(p, fresh[1]) < 0.05


@pytest.mark.parametrize("kind", list(CalibratorKind))
def test_every_kind_is_calibrated_on_fresh_data(kind, train, fresh):
    p = Calibrator(kind).fit(*train).predict(fresh[0])
    assert ((p >= 0) & (p <= 1)).all()
    assert expected_calibration_error(p, fresh[1]) < 0.05


def test_platt_matches_sklearn(train):
    from sklearn.linear_model import LogisticRegression

    X, y = train
    cal = Calibrator(CalibratorKind.PLATT).fit(X, y)
    Z = (X - X.mean(0)) / X.std(0)
    ref = LogisticRegression(C=1.0, solver="lbfgs", max_iter=1000).fit(Z, y)
    np.testing.assert_allclose(cal.predict(X), ref.predict_proba(Z)[:, 1], atol=1e-9)
    np.testing.assert_allclose(cal.score(X), ref.decision_function(Z), atol=1e-9)


def test_isotonic_matches_sklearn_and_is_monotone_in_score(train, fresh):
    from sklearn.isotonic import IsotonicRegression

    cal = Calibrator(CalibratorKind.ISOTONIC).fit(*train)
    platt = Calibrator(CalibratorKind.PLATT).fit(*train)
    np.testing.assert_allclose(cal.score(fresh[0]), platt.score(fresh[0]))
    ref = IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(cal.score(train[0]), train[1])
    np.testing.assert_allclose(cal.predict(fresh[0]), ref.predict(cal.score(fresh[0])), atol=1e-12)
    order = np.argsort(cal.score(fresh[0]), kind="stable")
    assert (np.diff(cal.predict(fresh[0])[order]) >= 0).all()


def test_isotonic_over_a_platt_fit_is_the_isotonic_fit(train, fresh):
    """The comparison's (d) from (c)'s logistic fit: exactly what fitting isotonic anew gives (the same
    logistic regression on the same standardised data), constant targets and bad input included."""
    X, y = train
    platt = Calibrator(CalibratorKind.PLATT).fit(X, y)
    iso, again = platt.isotonic_over(X, y), Calibrator(CalibratorKind.ISOTONIC).fit(X, y)
    assert iso.kind is CalibratorKind.ISOTONIC
    np.testing.assert_array_equal(iso.predict(fresh[0]), again.predict(fresh[0]))
    assert iso.to_dict() == again.to_dict()
    flat = np.zeros_like(y)
    assert Calibrator(CalibratorKind.PLATT).fit(X, flat).isotonic_over(X, flat).predict(X[:3]).tolist() == [0.0] * 3
    with pytest.raises(ConfigError, match="needs a fitted platt"):
        again.isotonic_over(X, y)
    with pytest.raises(ConfigError, match="F=.* signals"):
        platt.isotonic_over(X[:, :3], y)


def test_maxprob_uses_only_top1_prob(train):
    cal = Calibrator(CalibratorKind.MAXPROB).fit(*train)
    X = train[0].copy()
    np.testing.assert_array_equal(cal.score(X), X[:, 0])
    X[:, 1:] = 123.0
    np.testing.assert_array_equal(cal.predict(X), cal.predict(train[0]))


@pytest.mark.parametrize("kind", list(CalibratorKind))
def test_from_dict_predicts_identically(kind, train, fresh):
    cal = Calibrator(kind).fit(*train)
    back = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back.kind is kind
    assert np.max(np.abs(back.predict(fresh[0]) - cal.predict(fresh[0]))) < 1e-9
    assert np.max(np.abs(back.score(fresh[0]) - cal.score(fresh[0]))) < 1e-9


@pytest.mark.parametrize("kind", list(CalibratorKind))
@pytest.mark.parametrize("value", [0, 1])
def test_degenerate_targets_predict_the_rate(kind, value, train):
    X = train[0][:50]
    cal = Calibrator(kind).fit(X, np.full(50, value))
    np.testing.assert_array_equal(cal.predict(train[0]), float(value))
    back = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_array_equal(back.predict(train[0]), float(value))


def test_calibrator_errors(train):
    X, y = train
    with pytest.raises(ConfigError, match="not fitted"):
        Calibrator().predict(X)
    with pytest.raises(ConfigError, match="unknown calibrator kind 'temperature'"):
        Calibrator("temperature")
    with pytest.raises(ConfigError, match="targets must be 0/1"):
        Calibrator().fit(X, np.full(len(y), 2))
    with pytest.raises(ConfigError, match="NaN or infinite"):
        Calibrator().fit(np.full((3, F), np.nan), np.array([0, 1, 0]))
    with pytest.raises(ConfigError, match="empty split"):
        Calibrator().fit(np.zeros((0, F)), np.zeros(0))
    cal = Calibrator(CalibratorKind.PLATT).fit(X, y)
    with pytest.raises(ConfigError, match="fitted on F=6 signals, got F=2"):
        cal.predict(X[:, :2])
    with pytest.raises(ConfigError, match="missing fields"):
        Calibrator.from_dict({"kind": "platt"})


def test_fit_calibrators_skips_the_last_exit(train):
    X, y = train
    cals = fit_calibrators({3: X, 6: X, 9: X}, {3: y, 6: y}, "platt")  # targets of the decision exits
    assert sorted(cals) == [3, 6]
    assert all(c.kind is CalibratorKind.PLATT for c in cals.values())
    with pytest.raises(ConfigError, match="not the decision exits"):
        fit_calibrators({3: X, 6: X, 9: X}, {3: y}, "platt")
    with pytest.raises(ConfigError, match="not the decision exits"):
        fit_calibrators({3: X, 6: X}, {3: y, 6: y}, "platt")
    with pytest.raises(ConfigError, match="at least 2 exits"):
        fit_calibrators({3: X}, {3: y}, "platt")


def test_ece_small_when_calibrated_large_when_not():
    rng = np.random.default_rng(2)
    p = rng.uniform(size=20000)
    y = (rng.uniform(size=p.size) < p).astype(int)
    assert expected_calibration_error(p, y) < 0.02
    overconfident = np.full(p.size, 0.95)
    y_half = (rng.uniform(size=p.size) < 0.5).astype(int)
    assert expected_calibration_error(overconfident, y_half) == pytest.approx(0.45, abs=0.02)


def test_brier_and_reliability_curve_hand_computed():
    assert brier_score([0.1, 0.8, 0.5], [0, 1, 1]) == pytest.approx((0.01 + 0.04 + 0.25) / 3)
    conf, acc, count = reliability_curve(np.array([0.05, 0.15, 0.95, 1.0]), np.array([0, 1, 1, 0]), bins=10)
    np.testing.assert_array_equal(count, [1, 1, 0, 0, 0, 0, 0, 0, 0, 2])
    assert conf[0] == pytest.approx(0.05) and acc[0] == 0.0
    assert conf[9] == pytest.approx(0.975) and acc[9] == 0.5
    assert np.isnan(conf[2]) and np.isnan(acc[2])
    ece = expected_calibration_error(np.array([0.05, 0.15, 0.95, 1.0]), np.array([0, 1, 1, 0]), bins=10)
    assert ece == pytest.approx((0.05 + 0.85 + 2 * 0.475) / 4)


def test_metric_errors():
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        brier_score([1.5], [1])
    with pytest.raises(ConfigError, match="equal length"):
        expected_calibration_error([0.5, 0.5], [1])
    with pytest.raises(ConfigError, match="bins must be a positive integer"):
        reliability_curve([0.5], [1], bins=0)


def test_reliability_diagram_writes_png(tmp_path):
    rng = np.random.default_rng(3)
    p = rng.uniform(size=500)
    y = (rng.uniform(size=500) < p).astype(int)
    out = reliability_diagram({"isotonic": reliability_curve(p, y), "raw": reliability_curve(p ** 2, y)},
                              tmp_path / "fig" / "rel.png", "test")
    assert_png(out)  # decodes, not blank
    assert [f.name for f in out.parent.iterdir()] == ["rel.png"]  # no temp file left behind
