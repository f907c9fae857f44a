"""The running estimate of a measured time: the first observation sets it, later ones move it by alpha of
their distance, and an outlier counts as ``outlier`` times the estimate, never more."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from edge.runtime.estimate import capped_ema


def test_the_first_observation_is_the_estimate():
    assert capped_ema(None, 2.5, 0.2, 3.0) == 2.5


def test_an_ordinary_observation_moves_the_estimate_by_alpha_of_its_distance():
    assert capped_ema(1.0, 2.0, 0.2, 3.0) == pytest.approx(1.2)
    assert capped_ema(1.0, 0.5, 0.2, 3.0) == pytest.approx(0.9)


def test_an_outlier_counts_as_outlier_times_the_estimate():
    # a 100x pause moves the estimate as a 3x observation would: 1 + 0.2 * (3 - 1)
    assert capped_ema(1.0, 100.0, 0.2, 3.0) == pytest.approx(1.4)
    assert capped_ema(1.0, 100.0, 0.2, 3.0) == capped_ema(1.0, 3.0, 0.2, 3.0)


@given(est=st.floats(1e-6, 1e3), value=st.floats(0, 1e6), alpha=st.floats(0.01, 1), outlier=st.floats(1, 10))
def test_the_estimate_stays_between_the_old_one_and_the_capped_observation(est, value, alpha, outlier):
    new = capped_ema(est, value, alpha, outlier)
    lo, hi = sorted((est, min(value, outlier * est)))
    # est + alpha * (x - est) rounds at the scale of the larger operand (alpha = 1, x ~ 0: 1 + (x - 1) is 0.0)
    tol = 1e-12 * hi
    assert lo - tol <= new <= hi + tol


def test_a_tiny_observation_with_alpha_one_rounds_at_the_estimates_scale():
    # the case hypothesis found: the new estimate is the observation up to the estimate's rounding
    assert capped_ema(1.0, 5.4547773081138836e-126, 1.0, 3.0) == pytest.approx(0.0, abs=1e-15)
