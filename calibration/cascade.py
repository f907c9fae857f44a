"""The exit cascade with one threshold, and its false exits counted at every threshold of a grid.

Exit rule: with one threshold lambda on the calibrated probabilities p_k, a
token exits at the first decision exit k (increasing layer order; the last
layer is never a decision point) with p_k >= lambda, else it runs to the last
layer, which is never a false exit. A *false exit* is an exit at k where the
exit's token differs from the full model's (y_k = 0).

Pure functions: arrays in, arrays out.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edge.core.errors import ConfigError


# ------------------------------------------------------------------ cascade
def _stack(probs: dict[int, np.ndarray], correct: dict[int, np.ndarray] | None,
           final_layer: int) -> tuple[list[int], np.ndarray, np.ndarray | None]:
    """Validate per-exit arrays; return decision layers, P [K, N] and Y [K, N] (bool)."""
    if not probs:
        raise ConfigError("cascade: no decision exits given (probs dict is empty)")
    layers = sorted(probs)
    if layers[-1] >= final_layer:
        raise ConfigError(f"cascade: decision exit {layers[-1]} is not before the final layer {final_layer}")
    if correct is not None and sorted(correct) != layers:
        raise ConfigError(f"cascade: correctness exits {sorted(correct)} differ from probability exits {layers}")
    P = []
    for k in layers:
        p = np.asarray(probs[k], dtype=np.float64)  # [N]
        if p.ndim != 1:
            raise ConfigError(f"exit {k}: probabilities must be 1-D [N], got shape {p.shape}")
        if P and p.shape != P[0].shape:
            raise ConfigError(f"exit {k}: {p.shape[0]} tokens, but exit {layers[0]} has {P[0].shape[0]}")
        if not np.isfinite(p).all():
            raise ConfigError(f"exit {k}: calibrated probabilities contain NaN or infinite values")
        P.append(p)
    if P[0].size == 0:
        raise ConfigError("empty split: no tokens")
    Y = None
    if correct is not None:
        Y = np.stack([np.asarray(correct[k]) for k in layers])  # [K, N]
        if Y.shape != (len(layers), P[0].size):
            raise ConfigError(f"cascade: correctness arrays must be [N={P[0].size}] per exit")
        if not np.isin(Y, (0, 1)).all():
            raise ConfigError("cascade: correctness must be 0/1 (1 = exit agrees with the last exit)")
        Y = Y.astype(bool)
    return layers, np.stack(P), Y


def _first_exit(P: np.ndarray, lam: float) -> np.ndarray:
    """P [K, N] -> index [N] of the first exit with p >= lam, or K where none."""
    hit = P >= lam  # [K, N]
    return np.where(hit.any(axis=0), np.argmax(hit, axis=0), P.shape[0])


def cascade(probs: dict[int, np.ndarray], lam: float, final_layer: int) -> np.ndarray:
    """Exit layer per token under threshold lam.

    Args:
        probs: decision exit layer -> calibrated probability [N]; all layers < final_layer.
        lam: threshold; a token exits at the first exit with p >= lam.
        final_layer: the last layer, returned for tokens that never exit.

    Returns:
        int64 exit layer [N].

    Raises:
        ConfigError: empty dict, a layer >= final_layer, shapes that disagree, NaN.
    """
    layers, P, _ = _stack(probs, None, final_layer)
    table = np.asarray([*layers, final_layer], dtype=np.int64)  # [K + 1]
    return table[_first_exit(P, lam)]


class CascadeRisk(NamedTuple):
    """What a threshold does on a split."""

    false_exit_rate: float  # false exits / N over all tokens
    exit_fraction: dict[int, float]  # layer -> fraction of tokens exiting there (final layer included)
    layers_skipped_frac: float  # mean (final_layer - exit_layer) / final_layer


def cascade_risk(probs: dict[int, np.ndarray], correct: dict[int, np.ndarray], lam: float,
                 final_layer: int) -> CascadeRisk:
    """False-exit rate, exit-depth distribution and compute saved at threshold lam.

    Args:
        probs: decision exit layer -> calibrated probability [N].
        correct: same keys -> 0/1 [N], 1 where the exit's token equals the last exit's.
        lam: threshold.
        final_layer: the last layer.

    Raises:
        ConfigError: as :func:`cascade`, plus keys that differ or non-binary ``correct``.
    """
    layers, P, Y = _stack(probs, correct, final_layer)
    k, n = P.shape
    idx = _first_exit(P, lam)  # [N]
    exited = idx < k
    false = exited & ~Y[np.minimum(idx, k - 1), np.arange(n)]  # [N]
    table = np.asarray([*layers, final_layer], dtype=np.float64)
    counts = np.bincount(idx, minlength=k + 1)
    frac = {int(layer): float(c / n) for layer, c in zip([*layers, final_layer], counts)}
    skipped = float(np.mean((final_layer - table[idx]) / final_layer))
    return CascadeRisk(float(false.sum() / n), frac, skipped)


def false_exit_counts(probs: dict[int, np.ndarray], correct: dict[int, np.ndarray], lams: np.ndarray,
                      final_layer: int) -> np.ndarray:
    """Number of false exits at every threshold of a grid, in one pass.

    A token exits at decision exit k exactly for lam in (m_{k-1}, m_k], where m_k
    is the running max of its probabilities over the first k exits (m_0 = -inf).
    Each wrong exit k adds 1 to every grid point in its interval (difference array).

    Args:
        probs, correct, final_layer: as :func:`cascade_risk`.
        lams: thresholds [G], any order.

    Returns:
        int64 counts [G], aligned with ``lams``.
    """
    _, P, Y = _stack(probs, correct, final_layer)
    lams = np.asarray(lams, dtype=np.float64)  # [G]
    order = np.argsort(lams, kind="stable")
    g = lams[order]  # ascending
    M = np.maximum.accumulate(P, axis=0)  # [K, N] running max
    prev = np.vstack([np.full((1, P.shape[1]), -np.inf), M[:-1]])  # [K, N]
    wrong = ~Y & (M > prev)  # [K, N]: exit k is reachable and wrong
    start = np.searchsorted(g, prev[wrong], side="right")  # first grid index with lam > m_{k-1}
    stop = np.searchsorted(g, M[wrong], side="right")  # first grid index with lam > m_k
    diff = np.bincount(start, minlength=g.size + 1) - np.bincount(stop, minlength=g.size + 1)
    out = np.empty(g.size, dtype=np.int64)
    out[order] = np.cumsum(diff)[: g.size]
    return out


def unit_false_exit_counts(probs: dict[int, np.ndarray], correct: dict[int, np.ndarray], unit: np.ndarray,
                           n_units: int, lams: np.ndarray, final_layer: int) -> np.ndarray:
    """False exits of every unit at every threshold of a grid: :func:`false_exit_counts` per unit.

    Args:
        probs, correct, final_layer: as :func:`cascade_risk` (N tokens).
        unit: int [N], the unit (prompt) each token belongs to, in [0, n_units).
        n_units: U.
        lams: thresholds [G], any order.

    Returns:
        int64 counts [U, G], columns aligned with ``lams``.

    Raises:
        ConfigError: as :func:`cascade_risk`, or unit ids of the wrong shape or range.
    """
    _, P, Y = _stack(probs, correct, final_layer)
    unit = np.asarray(unit)
    if unit.shape != (P.shape[1],) or not np.issubdtype(unit.dtype, np.integer):
        raise ConfigError(f"unit ids must be integers [N={P.shape[1]}], got {unit.dtype} {unit.shape}")
    if n_units < 1 or unit.min() < 0 or unit.max() >= n_units:
        raise ConfigError(f"unit ids must be in [0, {n_units})")
    lams = np.asarray(lams, dtype=np.float64)  # [G]
    order = np.argsort(lams, kind="stable")
    g = lams[order]
    M = np.maximum.accumulate(P, axis=0)  # [K, N]
    prev = np.vstack([np.full((1, P.shape[1]), -np.inf), M[:-1]])
    wrong = ~Y & (M > prev)  # [K, N]
    owner = np.broadcast_to(unit, P.shape)[wrong]  # unit of each reachable wrong exit
    start = np.searchsorted(g, prev[wrong], side="right")
    stop = np.searchsorted(g, M[wrong], side="right")
    width = g.size + 1
    diff = (np.bincount(owner * width + start, minlength=n_units * width)
            - np.bincount(owner * width + stop, minlength=n_units * width)).reshape(n_units, width)
    out = np.empty((n_units, g.size), dtype=np.int64)
    out[:, order] = np.cumsum(diff, axis=1)[:, : g.size]
    return out
