"""The Platt score's arithmetic: a logistic regression on the standardised signals (Platt 1999,
"Probabilistic outputs for support vector machines"), the sigmoid that turns a logit into a probability,
and the logit a probability level needs (:class:`calibration.calibrators.Calibrator`'s platt and mlp kinds)."""
from __future__ import annotations

import numpy as np


def sigmoid(s: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function, elementwise."""
    e = np.exp(-np.abs(s))
    return np.where(s >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def fit_logistic(z: np.ndarray, y: np.ndarray, C: float) -> tuple[np.ndarray, float]:
    """(coef [F], intercept) of the L2 logistic regression of 0/1 targets y [N] on standardised signals z [N, F]
    (``C``: inverse L2 strength, sklearn's)."""
    from sklearn.linear_model import LogisticRegression

    lr = LogisticRegression(C=C, solver="lbfgs", max_iter=1000)
    lr.fit(z, y)
    return lr.coef_[0].astype(np.float64), float(lr.intercept_[0])


def sigmoid_threshold(lam: float) -> float:
    """Smallest logit s with sigmoid(s) >= lam: -inf for lam <= 0, +inf for lam >= 1."""
    if lam <= 0.0:
        return -np.inf
    if lam >= 1.0:
        return np.inf
    return float(np.log(lam / (1.0 - lam)))
