"""Learn-then-Test threshold search with a certified cascade false-exit bound.

Exit rule: with one threshold lambda on the calibrated probabilities p_k, a
token exits at the first decision exit k (increasing layer order; the last
layer is never a decision point) with p_k >= lambda, else it runs to the last
layer, which is never a false exit. A *false exit* is an exit at k where the
exit's token differs from the full model's (y_k = 0). The cascade false-exit
rate is R(lambda) = #false exits / N over all tokens.

R is not monotone in lambda (a looser threshold can move a token's exit from a
wrong to a right layer), so we use Learn then Test (Angelopoulos, Bates,
Candes, Jordan, Lei 2021, "Learn then Test: Calibrating Predictive Algorithms
to Achieve Risk Control"): for each lambda on a grid fixed before seeing the
data test H0: R(lambda) > eps with a valid p-value, walking from strict to
loose (fixed-sequence testing) and stopping at the first non-rejection. The
family-wise error is <= delta with no multiplicity correction, so
P[R(chosen lambda) > eps] <= delta (LTT Prop. 3; CALM, Schuster et al. 2022,
sec. 3). The p-values assume the calibration tokens are i.i.d. draws from the
deployment distribution.

p-values (Bates, Angelopoulos, Lei, Malik, Jordan 2021, "Distribution-free,
risk-controlling prediction sets", sec. 3.1): Hoeffding, exact binomial (the
loss is 0/1, so the count of false exits is Binomial(n, R)), and
Hoeffding-Bentkus.
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np
from scipy.stats import binom

from edge.errors import ConfigError

NEVER_EXIT: float = 2.0  # chosen lambda when even the strictest candidate fails: no p in [0, 1] reaches it
DEFAULT_GRID_SIZE = 1001  # lambda = 1.000, 0.999, ..., 0.000


class PValue(str, enum.Enum):
    HOEFFDING_BENTKUS = "hoeffding_bentkus"
    BINOMIAL = "binomial"
    HOEFFDING = "hoeffding"


def _method(method: PValue | str) -> PValue:
    try:
        return PValue(method)
    except ValueError:
        raise ConfigError(f"unknown p-value method {method!r}; expected one of {[m.value for m in PValue]}") from None


def _check_unit(value: float, name: str) -> float:
    if not (isinstance(value, (int, float, np.floating, np.integer)) and 0.0 < float(value) < 1.0):
        raise ConfigError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


def _check_n(n: int) -> int:
    if int(n) != n or n < 1:
        raise ConfigError(f"number of calibration tokens n must be a positive integer, got {n!r}")
    return int(n)


# ----------------------------------------------------------------- p-values
def _h1(a: np.ndarray, b: float) -> np.ndarray:
    """KL divergence of Bernoulli(a) from Bernoulli(b), with 0 log 0 = 0; a in [0, 1], b in (0, 1)."""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = np.where(a > 0, a * np.log(a / b), 0.0)
        t2 = np.where(a < 1, (1 - a) * np.log((1 - a) / (1 - b)), 0.0)
    return t1 + t2


def _pvalue(r_hat: np.ndarray, k: np.ndarray, n: int, eps: float, method: PValue) -> np.ndarray:
    """p-value of H0: R > eps from empirical risk r_hat and false-exit count k (unvalidated)."""
    if method is PValue.HOEFFDING:
        return np.exp(-2.0 * n * np.maximum(eps - r_hat, 0.0) ** 2)
    p_binom = binom.cdf(k, n, eps)
    if method is PValue.BINOMIAL:
        return p_binom
    p_hoeff = np.exp(-n * _h1(np.minimum(r_hat, eps), eps))
    return np.minimum(np.minimum(p_hoeff, math.e * p_binom), 1.0)


def _pvalue_counts(k: np.ndarray, n: int, eps: float, method: PValue) -> np.ndarray:
    k = np.asarray(k, dtype=np.int64)
    return _pvalue(k / n, k, n, eps, method)


def _checked_rate(r_hat: Any, n: int, eps: float) -> tuple[np.ndarray, np.ndarray, int, float]:
    n = _check_n(n)
    eps = _check_unit(eps, "epsilon")
    r = np.asarray(r_hat, dtype=np.float64)
    if not np.isfinite(r).all() or (r < 0).any() or (r > 1).any():
        raise ConfigError(f"empirical risk must be in [0, 1], got {r_hat!r}")
    k = np.ceil(n * r - 1e-9).astype(np.int64)  # observed count; the 1e-9 absorbs k/n rounding
    return r, k, n, eps


def hoeffding_pvalue(r_hat: float | np.ndarray, n: int, eps: float) -> float | np.ndarray:
    """Hoeffding p-value exp(-2 n (eps - r_hat)_+^2) for H0: R > eps (Bates et al. 2021, eq. 7).

    Raises:
        ConfigError: n < 1, eps outside (0, 1), r_hat outside [0, 1].
    """
    r, k, n, eps = _checked_rate(r_hat, n, eps)
    return _pvalue(r, k, n, eps, PValue.HOEFFDING)[()]


def binomial_pvalue(r_hat: float | np.ndarray, n: int, eps: float) -> float | np.ndarray:
    """Exact binomial p-value P[Binomial(n, eps) <= k], k = n * r_hat the false-exit count.

    Raises:
        ConfigError: n < 1, eps outside (0, 1), r_hat outside [0, 1].
    """
    r, k, n, eps = _checked_rate(r_hat, n, eps)
    return _pvalue(r, k, n, eps, PValue.BINOMIAL)[()]


def hoeffding_bentkus_pvalue(r_hat: float | np.ndarray, n: int, eps: float) -> float | np.ndarray:
    """Hoeffding-Bentkus p-value min(exp(-n h1(r_hat ^ eps, eps)), e * P[Bin(n, eps) <= k])
    (Bates et al. 2021, Prop. 3.2; h1 is the Bernoulli KL divergence).

    Raises:
        ConfigError: n < 1, eps outside (0, 1), r_hat outside [0, 1].
    """
    r, k, n, eps = _checked_rate(r_hat, n, eps)
    return _pvalue(r, k, n, eps, PValue.HOEFFDING_BENTKUS)[()]


def upper_confidence_bound(k_false: int, n: int, delta: float,
                           method: PValue | str = PValue.HOEFFDING_BENTKUS) -> float:
    """Certified bound: the smallest eps' with p-value(k/n, n, eps') <= delta.

    With probability >= 1 - delta the true false-exit rate is <= this bound.
    Found by bisection on [k/n, 1] (p-values decrease in eps'); rounded up, so
    it is conservative by at most 1e-12.

    Raises:
        ConfigError: n < 1, k_false outside [0, n], delta outside (0, 1).
    """
    n = _check_n(n)
    delta = _check_unit(delta, "delta")
    method = _method(method)
    if int(k_false) != k_false or not 0 <= k_false <= n:
        raise ConfigError(f"false-exit count must be an integer in [0, {n}], got {k_false!r}")
    k = int(k_false)
    lo, hi = k / n, 1.0  # invariant: hi passes (or is 1.0, the trivial bound)
    while hi - lo > 1e-12:
        mid = 0.5 * (lo + hi)
        if _pvalue_counts(k, n, mid, method) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def min_calibration_tokens(eps: float, delta: float, method: PValue | str = PValue.HOEFFDING_BENTKUS) -> int:
    """Smallest n at which zero observed false exits certifies eps at level delta.

    Binomial: (1 - eps)^n <= delta. Hoeffding-Bentkus: at zero errors its
    Hoeffding-KL term is also (1 - eps)^n (h1(0, eps) = -log(1 - eps)), so it
    needs the same n. Hoeffding: exp(-2 n eps^2) <= delta. Computed by search
    against the same p-value function the test uses, so n passes and n - 1 fails.

    Raises:
        ConfigError: eps or delta outside (0, 1).
    """
    eps = _check_unit(eps, "epsilon")
    delta = _check_unit(delta, "delta")
    method = _method(method)

    def passes(n: int) -> bool:
        return bool(_pvalue_counts(0, n, eps, method) <= delta)

    hi = 1
    while not passes(hi):
        hi *= 2
        if hi > 1 << 40:  # pragma: no cover - eps/delta this small are not a real request
            raise ConfigError(f"epsilon={eps}, delta={delta} need more than 2^40 calibration tokens")
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


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


# ------------------------------------------------------------------- search
@dataclass
class ThresholdSearchResult:
    """The chosen threshold and its certificate.

    ``lam`` is :data:`NEVER_EXIT` when even the strictest candidate was not
    certified (then no token exits). ``bound`` is the (1 - delta) upper
    confidence bound on the false-exit rate at ``lam``; <= eps when certified.
    ``tested`` holds (lam, r_hat, p_value) for every hypothesis actually tested,
    in order, the last being the first failure (if any).
    """

    lam: float
    n: int
    eps: float
    delta: float
    method: PValue
    empirical_risk: float
    bound: float
    exit_fraction: dict[int, float]
    layers_skipped_frac: float
    tested: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def certified(self) -> bool:
        """True when some real threshold passed (tokens may exit)."""
        return self.lam <= 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (layer keys become strings)."""
        d = asdict(self)
        d["method"] = self.method.value
        d["exit_fraction"] = {str(k): v for k, v in self.exit_fraction.items()}
        d["tested"] = [list(t) for t in self.tested]
        return d


def default_grid(size: int = DEFAULT_GRID_SIZE) -> np.ndarray:
    """Thresholds 1.0 -> 0.0 in equal steps, strict to loose.

    Fixed in advance rather than taken from quantiles of the calibration
    probabilities: fixed-sequence testing needs the order of hypotheses chosen
    before seeing the data (LTT sec. 4).
    """
    return np.linspace(1.0, 0.0, size)


def learn_then_test(probs: dict[int, np.ndarray], correct: dict[int, np.ndarray], final_layer: int,
                    eps: float = 0.009, delta: float = 0.05,
                    method: PValue | str = PValue.HOEFFDING_BENTKUS,
                    grid: np.ndarray | None = None) -> ThresholdSearchResult:
    """Choose the loosest threshold whose cascade false-exit rate is certified <= eps.

    Fixed-sequence testing over ``grid`` from strict (high) to loose: reject
    H0: R(lam) > eps while p-value <= delta, stop at the first failure; the
    chosen lam is the last rejection. Guarantee: P[R(lam) > eps] <= delta over
    draws of i.i.d. calibration tokens.

    Args:
        probs: decision exit layer -> calibrated probability [N].
        correct: same keys -> 0/1 [N].
        final_layer: the last layer.
        eps: tolerated false-exit rate, in (0, 1).
        delta: failure probability of the certificate, in (0, 1).
        method: p-value, see :class:`PValue`.
        grid: candidate thresholds; sorted strict to loose and deduplicated.
            Default :func:`default_grid` (1001 values, step 0.001).

    Returns:
        :class:`ThresholdSearchResult`.

    Raises:
        ConfigError: eps or delta outside (0, 1), fewer tokens than
            :func:`min_calibration_tokens`, NaN probabilities, bad shapes or grid.
    """
    eps = _check_unit(eps, "epsilon")
    delta = _check_unit(delta, "delta")
    method = _method(method)
    _, P, _ = _stack(probs, correct, final_layer)
    n = P.shape[1]
    n_min = min_calibration_tokens(eps, delta, method)
    if n < n_min:
        raise ConfigError(f"learn_then_test: {n} calibration tokens cannot certify epsilon={eps} at "
                          f"delta={delta} with the {method.value} p-value; need at least {n_min} tokens "
                          f"(even with zero false exits), got {n}")
    lams = default_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    if lams.ndim != 1 or lams.size == 0 or not np.isfinite(lams).all():
        raise ConfigError(f"learn_then_test: grid must be a non-empty 1-D array of finite thresholds, "
                          f"got shape {lams.shape}")
    lams = np.unique(lams)[::-1]  # strict -> loose

    k = false_exit_counts(probs, correct, lams, final_layer)  # [G]
    pv = _pvalue_counts(k, n, eps, method)  # [G]
    passed = pv <= delta
    n_pass = lams.size if passed.all() else int(np.argmin(passed))  # index of the first failure
    n_tested = min(n_pass + 1, lams.size)
    tested = [(float(lams[i]), float(k[i] / n), float(pv[i])) for i in range(n_tested)]
    lam = float(lams[n_pass - 1]) if n_pass > 0 else NEVER_EXIT
    k_chosen = int(k[n_pass - 1]) if n_pass > 0 else 0
    cr = cascade_risk(probs, correct, lam, final_layer)
    return ThresholdSearchResult(
        lam=lam, n=n, eps=eps, delta=delta, method=method, empirical_risk=k_chosen / n,
        bound=upper_confidence_bound(k_chosen, n, delta, method), exit_fraction=cr.exit_fraction,
        layers_skipped_frac=cr.layers_skipped_frac, tested=tested)
