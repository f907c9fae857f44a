"""Calibration metrics of predicted probabilities against 0/1 outcomes: the reliability curve, the expected
calibration error (ECE) and the Brier score. Pure functions of (p, y)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from edge.core.errors import ConfigError


class ReliabilityCurve(NamedTuple):
    """Per equal-width bin: mean confidence, accuracy (NaN where the bin is empty) and count."""

    conf: np.ndarray  # [bins]
    acc: np.ndarray  # [bins]
    count: np.ndarray  # [bins] int64


def _check_py(p: Any, y: Any, bins: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(p, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if p.ndim != 1 or p.shape != y.shape:
        raise ConfigError(f"metrics: p and y must be 1-D of equal length, got {p.shape} and {y.shape}")
    if p.size == 0:
        raise ConfigError("empty split: no tokens")
    if not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise ConfigError("metrics: probabilities must be finite and in [0, 1]")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ConfigError("metrics: targets must be 0/1")
    if bins is not None and (int(bins) != bins or bins < 1):
        raise ConfigError(f"metrics: bins must be a positive integer, got {bins}")
    return p, y


def reliability_curve(p: np.ndarray, y: np.ndarray, bins: int = 15) -> ReliabilityCurve:
    """Reliability diagram data over ``bins`` equal-width bins of [0, 1] (Guo et al. 2017).

    Args:
        p: predicted probabilities [N] in [0, 1].
        y: 0/1 outcomes [N].
        bins: number of bins; p == 1 falls in the last bin.

    Returns:
        :class:`ReliabilityCurve` (conf, acc, count), each [bins]; empty bins have NaN conf/acc.

    Raises:
        ConfigError: bad shapes, p outside [0, 1], non-binary y, bins < 1.
    """
    p, y = _check_py(p, y, bins)
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)  # [N]
    count = np.bincount(idx, minlength=bins)  # [bins]
    with np.errstate(invalid="ignore", divide="ignore"):
        conf = np.bincount(idx, weights=p, minlength=bins) / count
        acc = np.bincount(idx, weights=y, minlength=bins) / count
    return ReliabilityCurve(conf, acc, count.astype(np.int64))


def expected_calibration_error(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """ECE = sum_b (n_b / N) |acc_b - conf_b| over equal-width bins (Guo et al. 2017,
    "On Calibration of Modern Neural Networks").

    Raises:
        ConfigError: as :func:`reliability_curve`.
    """
    conf, acc, count = reliability_curve(p, y, bins)
    full = count > 0
    return float((count[full] * np.abs(acc[full] - conf[full])).sum() / count.sum())


def brier_score(p: np.ndarray, y: np.ndarray) -> float:
    """Mean squared error of probabilities against 0/1 outcomes (Brier 1950).

    Raises:
        ConfigError: bad shapes, p outside [0, 1], non-binary y.
    """
    p, y = _check_py(p, y)
    return float(np.mean((p - y) ** 2))
