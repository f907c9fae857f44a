"""The mlp calibrator's networks fitted in spawned processes (calibration.mlp_score.fit_pool): the same calibrators
as fitted in process, bit for bit (each fit is seeded and runs on one BLAS thread wherever it runs), for one set and
for cross-fitting's folds fitted together; degenerate targets fit nothing; a one-worker pool is no pool."""
from __future__ import annotations

import numpy as np
import pytest

from calibration.calibrators import Calibrator, CalibratorKind, fit_calibrator_sets, fit_calibrators
from calibration.certify import cross_fitted
from calibration.collect import Collected
from calibration.mlp_score import fit_mlps, fit_pool
from edge.core.errors import ConfigError
from edge.pipeline.calibrate_config import CalibrateConfig

F = 12


def _problem(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Signals [n, F] and targets of log-odds 4 x0 x1: a problem a linear score cannot fit (held out: a network
    fitted on 1500 rows 0.72 accurate, Platt 0.50)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, F))
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-4 * X[:, 0] * X[:, 1]))).astype(np.int64)
    return X, y


def _same(a: dict[int, Calibrator], b: dict[int, Calibrator]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        for name in ("w1", "b1", "w2", "mean", "std"):
            np.testing.assert_array_equal(getattr(a[k], name), getattr(b[k], name), err_msg=f"exit {k} {name}")
        assert a[k].b2 == b[k].b2 and a[k].constant == b[k].constant


@pytest.fixture(scope="module")
def pool():
    with fit_pool(2) as p:
        assert p is not None and p.workers == 2
        yield p


def test_pool_fits_the_same_networks_as_in_process(pool):
    sets = [({2: _problem(1500, s)[0], 4: _problem(1500, s + 10)[0], 6: _problem(10, 0)[0]},
             {2: _problem(1500, s)[1], 4: _problem(1500, s + 10)[1]}) for s in (0, 1)]
    here = fit_calibrator_sets(sets, CalibratorKind.MLP)
    there = fit_calibrator_sets(sets, CalibratorKind.MLP, pool=pool)
    for a, b in zip(here, there):
        _same(a, b)
    # one set through fit_calibrators is the first of the sets; the fit is not trivial (the interaction is learnt)
    _same(fit_calibrators(*sets[0], kind="mlp", pool=pool), here[0])
    X, y = _problem(4000, 7)
    linear = Calibrator(kind=CalibratorKind.PLATT).fit(*_problem(1500, 0))
    assert ((here[0][2].predict(X) > 0.5) == y).mean() > ((linear.predict(X) > 0.5) == y).mean() + 0.1
    # and the networks equal a direct Calibrator.fit's, which fits in process
    _same({2: Calibrator(kind=CalibratorKind.MLP).fit(sets[1][0][2], sets[1][1][2])}, {2: there[1][2]})


def test_degenerate_targets_fit_no_network(pool):
    X, y = _problem(500, 3)
    cals = fit_calibrators({1: X, 2: X, 3: X}, {1: np.ones(500, np.int64), 2: y}, "mlp", pool=pool)
    assert cals[1].constant == 1.0 and cals[1].w1.size == 0
    assert cals[2].constant is None and cals[2].w1.shape == (F, 16)


def test_cross_fitting_with_a_pool_is_cross_fitting_without(pool):
    units, per = 40, 30
    X, y = _problem(units * per, 5)
    final = np.full(units * per, 7)
    data = Collected(exit_layers=[3, 6], signals={3: X, 6: X}, argmax={3: np.where(y == 1, 7, 8), 6: final},
                     next_token=final, unit=np.repeat(np.arange(units), per), n_units=units)
    a = cross_fitted(data, CalibratorKind.MLP, seed=1)
    b = cross_fitted(data, CalibratorKind.MLP, seed=1, pool=pool)
    np.testing.assert_array_equal(a[3], b[3])


def test_one_worker_is_no_pool_and_the_config_refuses_a_negative_count():
    with fit_pool(1) as p:
        assert p is None
    X, y = _problem(300, 2)
    assert len(fit_mlps([((X - X.mean(0)) / X.std(0), y.astype(float), 0)], None)) == 1
    with pytest.raises(ConfigError, match="fit_workers"):
        CalibrateConfig(fit_workers=-1)


def test_calibrate_takes_a_process_per_core_up_to_the_largest_round_of_fits(monkeypatch):
    """calibrate's pool: one process per core, at most the cross-fitting round's two fits per decision exit; the
    kinds that fit in process take none; an explicit count is kept."""
    from types import SimpleNamespace

    from edge.pipeline import calibrate

    model = SimpleNamespace(exit_layers=[1, 2, 4, 12])  # three decision exits: six fits at most at once
    mlp = CalibrateConfig(calibrator="mlp")
    for cores, want in ((1, 1), (2, 2), (12, 6)):
        monkeypatch.setattr(calibrate.os, "cpu_count", lambda c=cores: c)
        assert calibrate.fit_workers(mlp, model) == want
    assert calibrate.fit_workers(CalibrateConfig(calibrator="mlp", fit_workers=3), model) == 3
    assert calibrate.fit_workers(CalibrateConfig(calibrator="platt"), model) == 1
