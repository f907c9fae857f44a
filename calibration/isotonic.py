"""The isotonic step's arithmetic: an order-preserving map of a raw score to a probability (Zadrozny & Elkan
2002, "Transforming classifier scores into accurate multiclass probability estimates"), kept as its knots,
and the score a probability level needs (:class:`calibration.calibrators.Calibrator`'s isotonic and maxprob
kinds)."""
from __future__ import annotations

import numpy as np


def fit_isotonic(s: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knots (iso_x [T], iso_y [T]) of the non-decreasing isotonic regression of 0/1 targets y [N] on raw
    scores s [N], clipped to [0, 1]."""
    from sklearn.isotonic import IsotonicRegression

    iso = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0, increasing=True)
    iso.fit(s, y)
    return np.asarray(iso.X_thresholds_, dtype=np.float64), np.asarray(iso.y_thresholds_, dtype=np.float64)


def isotonic_probability(s: np.ndarray, iso_x: np.ndarray, iso_y: np.ndarray) -> np.ndarray:
    """Probability [N] of raw scores s [N] on the knots: linear between them."""
    # np.interp clips to the end knots, as sklearn's out_of_bounds="clip"
    return np.clip(np.interp(s, iso_x, iso_y), 0.0, 1.0)


def isotonic_threshold(x: np.ndarray, y: np.ndarray, lam: float) -> float:
    """Smallest raw score s with :func:`isotonic_probability` (s) >= lam on knots (x, y) (+inf if none)."""
    if y[0] >= lam:
        return -np.inf
    idx = np.flatnonzero(y >= lam)
    if idx.size == 0:
        return np.inf
    i = int(idx[0])  # y[i-1] < lam <= y[i]: the crossing is on the segment (x[i-1], x[i]]
    if x[i] == x[i - 1]:
        return float(x[i])
    t = (lam - y[i - 1]) / (y[i] - y[i - 1])
    return float(x[i - 1] + t * (x[i] - x[i - 1]))
