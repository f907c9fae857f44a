"""Fit on one set of units, certify on another: the leak the split removes, the provisional threshold,
the walk that ends at it, and the direct test."""
from __future__ import annotations

import math

import numpy as np
import pytest

from calibration import certify as cert
from calibration.calibrators import CalibratorKind
from calibration.collect import Collected
from calibration.pvalues import PValue
from calibration.risk import NEVER_EXIT, default_grid, learn_then_test
from edge.core.errors import ConfigError

GRID = default_grid(201)


def _units(rng: np.random.Generator, units: int, per_unit: int, acc: float, informative: bool = False) -> Collected:
    """One decision exit (layer 1) before the last (layer 2). Signals are uniform noise; the exit agrees
    with the last layer with probability ``acc`` independently of them, or, when ``informative``, with
    probability rising with the first signal (mean ``acc``)."""
    n = units * per_unit
    sig = {1: rng.uniform(size=(n, 6)), 2: rng.uniform(size=(n, 6))}
    p = np.clip(acc + (sig[1][:, 0] - 0.5) * 2 * (1 - acc), 0, 1) if informative else np.full(n, acc)
    arg = {1: (rng.uniform(size=n) >= p).astype(np.int64), 2: np.zeros(n, np.int64)}
    return Collected([1, 2], sig, arg, np.zeros(n, np.int64), np.repeat(np.arange(units), per_unit), units)


def _violations(seeds: range, eps: float, delta: float) -> tuple[float, float]:
    """Fraction of seeds whose certified threshold has a true risk above eps: calibrators fitted on the
    certify units themselves (in-sample), and on separate fit units (the split)."""
    acc, units = 0.97, 300
    fresh = np.random.default_rng(10_000).uniform(size=(20_000, 6))
    bad = {"in-sample": 0, "split": 0}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        certify_units, fit_units = _units(rng, units, 1, acc), _units(rng, units, 1, acc)
        for name, fit_on in (("in-sample", certify_units), ("split", fit_units)):
            cals = cert.fit(fit_on, CalibratorKind.ISOTONIC)
            losses = cert.unit_losses(cert.calibrated(cals, certify_units), certify_units, GRID)
            lam = learn_then_test(losses, GRID, eps, delta, PValue.BETTING, seed).lam
            # signals are uninformative: a fresh token exits with the calibrator's P(p >= lam) and is
            # then wrong with probability 1 - acc, so this is the true false-exit rate
            true_risk = (1 - acc) * np.mean(cals[1].predict(fresh) >= lam)
            bad[name] += true_risk > eps
    return bad["in-sample"] / len(seeds), bad["split"] / len(seeds)


def _allowance(delta: float, reps: int) -> float:
    return delta + 3 * math.sqrt(delta * (1 - delta) / reps)


@pytest.mark.slow  # ~6 s: many seeds
def test_fitting_on_the_certify_units_breaks_the_guarantee_and_the_split_does_not():
    """Uninformative signals: isotonic regression's top blocks have in-sample accuracy 1 by chance, so
    in-sample fitting certifies thresholds that let tokens exit at the base error rate."""
    eps, delta, reps = 0.01, 0.1, 40
    in_sample, split = _violations(range(reps), eps, delta)
    assert in_sample > 0.3  # measured 0.5: the leak
    assert split <= _allowance(delta, reps)


@pytest.mark.slow
def test_the_split_controls_the_true_risk_over_many_seeds():
    eps, delta, reps = 0.01, 0.1, 200
    in_sample, split = _violations(range(100, 100 + reps), eps, delta)
    assert in_sample > 0.3
    assert split <= _allowance(delta, reps)


def test_cross_fitted_probabilities_never_come_from_their_own_units():
    rng = np.random.default_rng(1)
    data = _units(rng, 60, 5, 0.8, informative=True)
    oof = cert.cross_fitted(data, CalibratorKind.PLATT, folds=2, seed=3)
    group = np.random.default_rng(3).permutation(60) % 2
    for f in (0, 1):
        other = cert.fit(data.select_units(np.flatnonzero(group != f)), CalibratorKind.PLATT)
        rows = group[data.unit] == f
        np.testing.assert_allclose(oof[1][rows], other[1].predict(data.signals[1][rows]), rtol=1e-12)


def test_select_and_concat_units():
    rng = np.random.default_rng(2)
    data = _units(rng, 10, 3, 0.8)
    sub = data.select_units(np.array([7, 2]))
    assert sub.n_units == 2 and sub.n == 6
    np.testing.assert_array_equal(sub.unit, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(sub.signals[1], np.concatenate([data.signals[1][21:24], data.signals[1][6:9]]))
    both = Collected.concat([sub, data])
    assert both.n_units == 12 and both.unit[-1] == 11 and both.n == 36


def test_provisional_threshold_is_on_the_grid_and_certifiable():
    rng = np.random.default_rng(4)
    data = _units(rng, 400, 4, 0.9, informative=True)
    lam = cert.provisional_lambda(data, CalibratorKind.PLATT, GRID, 0.05, 0.1, PValue.BETTING, 400, seed=0)
    assert lam in GRID and lam < 1.0
    fresh = _units(rng, 400, 4, 0.9, informative=True)
    cals = cert.fit(data, CalibratorKind.PLATT)
    losses = cert.unit_losses(cert.calibrated(cals, fresh), fresh, GRID)
    assert losses[:, np.flatnonzero(GRID == lam)[0]].mean() < 0.05


def test_walk_ends_at_the_provisional_threshold_on_the_engines_own_losses():
    rng = np.random.default_rng(5)
    data = _units(rng, 400, 4, 0.9, informative=True)
    cals = cert.fit(_units(rng, 400, 4, 0.9, informative=True), CalibratorKind.PLATT)
    probs = cert.calibrated(cals, data)
    c = cert.certify(probs, data, GRID, 0.05, 0.1, PValue.BETTING, 0, lam_provisional=0.93)
    assert c.exact and c.lam == 0.93 and c.walk.tested[-1][0] == 0.93  # reached: certifies the generator
    assert c.empirical_risk <= c.bound <= 0.05
    # the last hypothesis is tested on what the engine emitted: bad observed losses stop the walk before it
    observed = np.full(400, 0.5)
    c2 = cert.certify(probs, data, GRID, 0.05, 0.1, PValue.BETTING, 0, lam_provisional=0.93, observed=observed)
    assert c2.certified and not c2.exact and c2.lam > 0.93 and c2.walk.tested[-1][0] == 0.93
    assert cert.truncated_grid(GRID, 0.8123)[-1] == 0.8123 and cert.truncated_grid(GRID, 1.0).tolist() == [1.0]


def test_nothing_certified_means_never_exit():
    rng = np.random.default_rng(6)
    data = _units(rng, 400, 2, 0.0)  # every early exit is wrong
    probs = {1: np.ones(data.n)}  # and the calibrator claims certainty
    c = cert.certify(probs, data, GRID, 0.05, 0.1, PValue.BETTING, 0, lam_provisional=0.9)
    assert not c.certified and c.lam == NEVER_EXIT and c.exit_fraction == {1: 0.0, 2: 1.0}


def test_direct_test():
    ok = cert.direct_test(np.zeros(500), 0.02, 0.1, PValue.BETTING, None)
    assert ok.passed and ok.mean == 0 and 0 < ok.bound < 0.02
    bad = cert.direct_test(np.full(500, 0.05), 0.02, 0.1, PValue.BETTING, None)
    assert not bad.passed and bad.bound > 0.05


def test_unit_losses_need_units():
    rng = np.random.default_rng(7)
    data = _units(rng, 10, 2, 0.8)
    data.unit = None
    with pytest.raises(ConfigError, match="unit-tagged"):
        cert.unit_losses({1: np.ones(20)}, data, GRID)


@pytest.mark.slow
def test_in_defer_mode_the_engine_decides_as_the_teacher_forced_cascade(micro_run):
    """The claim the certify walk rests on: with deferred (exact) K/V, the signals of every generated token
    at every exit are the teacher-forced signals of the full model on prompt + generated prefix, so the
    engine's exit layer is the cascade's on those signals. Disagreement is allowed only for a token whose
    score lies within float32 rounding of the threshold: the engine's softmax statistics come from a
    one-row decode step, the teacher-forced ones from a whole sequence; both float32, so they differ by
    a few ulps (~1e-7 relative), which the linear score scales by |w| |x|; 1e-4 (1 + |t|) bounds that
    generously."""
    from calibration.cascade import cascade
    from calibration.freerun import Served, free_run
    from calibration.table import TableRule, ThresholdTable
    from edge.core.data import Split, TokenCorpus, load_split
    from edge.runtime.engine_config import KVMode
    from edge.runtime.rules import NeverExit
    from edge.model.exits import load_multi_exit
    from edge.model.tokenizer import load_tokenizer

    ckpt = micro_run / "multi_exit"
    model = load_multi_exit(ckpt)
    prompts = TokenCorpus(load_tokenizer(ckpt), load_split(Split.CALIBRATION)).draw(24, 28, seed=0).ids[:, :16]
    full = free_run(Served.torch(model), prompts, 12, NeverExit(), KVMode.DEFER, batch=8)
    fe, mm = full.wrong()
    assert not fe.any() and not mm.any() and (full.judged == model.num_layers).all()
    cals = cert.fit(full.data, CalibratorKind.PLATT)
    lam = float(np.quantile(cert.calibrated(cals, full.data)[1], 0.6))  # about 40% exit at the first exit
    table = ThresholdTable("x", model.exit_layers, "platt", lam, {k: c.score_threshold(lam) for k, c in cals.items()},
                           cals)
    run = free_run(Served.torch(model), prompts, 12, TableRule(table), KVMode.DEFER, batch=8)
    probs = cert.calibrated(cals, run.data)
    tf = cascade(probs, lam, run.data.final).reshape(run.judged.shape)
    assert len(np.unique(run.judged)) > 1, "the test needs tokens exiting at different depths"
    differ = np.flatnonzero((tf != run.judged).ravel())
    for i in differ:
        k = min(tf.ravel()[i], run.judged.ravel()[i])
        s, t = cals[k].score(run.data.signals[k][i:i + 1])[0], table.score_thresholds[k]
        assert abs(s - t) <= 1e-4 * (1 + abs(t)), (i, s, t)
    assert run.unit_losses().shape == (24,) and ((run.unit_losses() >= 0) & (run.unit_losses() <= 1)).all()


@pytest.mark.parametrize("route", [0.0, 0.5])
def test_isotonic_over_platt_is_the_isotonic_fit_on_the_routed_tokens(route):
    """The comparison's (d) from (c)'s calibrators: the isotonic calibrators ``fit`` gives, with and without
    routing (only the tokens the routing checks are fitted on)."""
    from edge.model.candidates import LOOKUP_LEN

    data = _units(np.random.default_rng(3), 200, 10, 0.7, informative=True)
    for s in data.signals.values():  # a lookup_len column: half the tokens matched 2+ of 4
        s[:, LOOKUP_LEN] = np.random.default_rng(4).integers(0, 5, s.shape[0]) / 4
    platt = cert.fit(data, CalibratorKind.PLATT, route)
    iso, again = cert.isotonic_over(platt, data, route), cert.fit(data, CalibratorKind.ISOTONIC, route)
    assert iso.keys() == again.keys() == {1}
    assert iso[1].to_dict() == again[1].to_dict()
