"""p-values and upper confidence bounds for the mean of [0, 1]-bounded losses.

The certified quantity is the mean R of i.i.d. unit losses X_1..X_n in [0, 1]
(a unit is one prompt; its loss is its false-exit rate). Every function here
tests H0: R > epsilon (rejecting it certifies R <= epsilon) or inverts that test into
an upper confidence bound. All are valid for any distribution on [0, 1]:

- ``betting`` (the default): a capital process that bets against H0
  (Waudby-Smith & Ramdas 2024, "Estimating means of bounded random variables by
  betting", JRSS-B; sec. 3 and the aGRAPA bet of sec. 5):
  K_t = prod_{i<=t} (1 + b_i (epsilon - X_i)) with b_i in [0, 1/(1 - epsilon)) chosen
  from X_1..X_{i-1} only. Under H0, E[1 + b_i (epsilon - X_i) | past] <= 1, so K is
  a non-negative supermartingale and, by Ville's inequality,
  P(max_t K_t >= 1/delta) <= delta: p = min(1, 1 / max_t K_t). It adapts to the
  variance of X, which is small when X is a rate over dozens of tokens; the
  order of the units matters, so they are taken in a seeded random order.
- ``hoeffding_bentkus``: min(exp(-n h1(min(r, epsilon), epsilon)), e P[Bin(n, epsilon) <= ceil(n r)])
  (Bates, Angelopoulos, Lei, Malik, Jordan 2021, "Distribution-free,
  risk-controlling prediction sets", Prop. 3.2; valid for [0, 1] losses, not
  only 0/1). It treats every unit as if it had Bernoulli variance.
- ``hoeffding``: exp(-2 n (epsilon - r)_+^2) (ibid., eq. 7).
- ``binomial``: P[Bin(n, epsilon) <= sum X], exact, valid only for 0/1 losses; a
  ConfigError otherwise.

One method is chosen before the data are seen (the config); taking the
smallest of several p-values would need a multiplicity correction.
"""
from __future__ import annotations

import enum
import functools
import math

import numpy as np
from scipy.stats import binom

from edge.core.betting import Betting
from edge.core.errors import ConfigError


class PValue(str, enum.Enum):
    BETTING = "betting"
    HOEFFDING_BENTKUS = "hoeffding_bentkus"
    HOEFFDING = "hoeffding"
    BINOMIAL = "binomial"


def method_of(method: PValue | str) -> PValue:
    try:
        return PValue(method)
    except ValueError:
        raise ConfigError(f"unknown p-value method {method!r}; expected one of {[m.value for m in PValue]}") from None


def check_unit_interval(value: float, name: str) -> float:
    """``value`` as a float if it is strictly inside (0, 1), else a ConfigError naming ``name``."""
    if not (isinstance(value, (int, float, np.floating, np.integer)) and 0.0 < float(value) < 1.0):
        raise ConfigError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


def _losses(x: np.ndarray, method: PValue) -> np.ndarray:
    """Validate losses [n] or [n, G] in [0, 1]; return float64 [n, G]."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[0] == 0:
        raise ConfigError(f"losses must be [n] or [n, G] with n >= 1 units, got shape {x.shape}")
    if not np.isfinite(x).all() or (x < 0).any() or (x > 1).any():
        raise ConfigError("unit losses must be finite and in [0, 1]")
    if method is PValue.BINOMIAL and not np.isin(x, (0.0, 1.0)).all():
        raise ConfigError("the binomial p-value is exact for 0/1 losses only; per-unit false-exit rates "
                          "take values in [0, 1]: use betting or hoeffding_bentkus")
    return x


# --------------------------------------------------------------- the tests
def _h1(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """KL divergence of Bernoulli(a) from Bernoulli(b), with 0 log 0 = 0; a in [0, 1], b in (0, 1)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = np.where(a > 0, a * np.log(a / b), 0.0)
        t2 = np.where(a < 1, (1 - a) * np.log((1 - a) / (1 - b)), 0.0)
    return t1 + t2


def _closed_form(mean: np.ndarray, n: int, epsilon: np.ndarray, method: PValue) -> np.ndarray:
    """p-values that depend on the losses through their mean only; broadcasts mean and epsilon."""
    if method is PValue.HOEFFDING:
        return np.exp(-2.0 * n * np.maximum(epsilon - mean, 0.0) ** 2)
    k = np.ceil(n * mean - 1e-9)  # the 1e-9 absorbs rounding of k / n
    p_binom = binom.cdf(k, n, epsilon)
    if method is PValue.BINOMIAL:
        return p_binom
    p_hoeff = np.exp(-n * _h1(np.minimum(mean, epsilon), epsilon))
    return np.minimum(np.minimum(p_hoeff, math.e * p_binom), 1.0)


def _betting(x: np.ndarray, epsilon: np.ndarray) -> np.ndarray:
    """p = min(1, 1 / max_t K_t) per column: x [n, G] in the order given, epsilon [G] (or broadcastable)."""
    epsilon = np.asarray(epsilon, dtype=np.float64)
    test = Betting(np.broadcast_to(epsilon, np.broadcast_shapes(x.shape[1:], epsilon.shape)))
    for t in range(x.shape[0]):
        test.update(x[t])
    return test.p_value


def pvalues(losses: np.ndarray, epsilon: float | np.ndarray, method: PValue | str = PValue.BETTING,
            seed: int | None = 0) -> np.ndarray:
    """p-values of H0: mean > epsilon, one per column of ``losses``.

    Args:
        losses: unit losses in [0, 1], [n] or [n, G] (G hypotheses on the same n units).
        epsilon: the tolerated mean, a scalar in (0, 1) or one per column [G].
        method: see :class:`PValue`.
        seed: the random order of the units for ``betting`` (the same order for every column); None
            takes them in the order given, which must then be random already (e.g. the order in which
            i.i.d. units were drawn, as a sequential test that may stop early needs).

    Returns:
        float64 [G] in [0, 1].

    Raises:
        ConfigError: losses outside [0, 1] or empty, epsilon outside (0, 1), non-binary losses for
            ``binomial``, an unknown method.
    """
    method = method_of(method)
    x = _losses(losses, method)
    e = np.asarray(epsilon, dtype=np.float64)
    if e.ndim > 1 or not ((e > 0) & (e < 1)).all():
        raise ConfigError(f"epsilon must be in (0, 1), got {epsilon!r}")
    if method is PValue.BETTING:
        order = np.arange(x.shape[0]) if seed is None else np.random.default_rng(seed).permutation(x.shape[0])
        return _betting(x[order], e)
    return np.broadcast_to(_closed_form(x.mean(axis=0), x.shape[0], e, method), np.broadcast(x[0], e).shape).copy()


def upper_confidence_bound(losses: np.ndarray, delta: float, method: PValue | str = PValue.BETTING,
                           seed: int | None = 0) -> float:
    """The (1 - delta) upper confidence bound on the mean: the smallest b such that every epsilon >= b
    is certified (p-value <= delta); 1.0 when none below 1 is.

    Found on a grid of epsilon values and refined by bisection to 1e-9 (rounded up). The p-values are
    those of :func:`pvalues` with the same ``method`` and ``seed``.

    Raises:
        ConfigError: as :func:`pvalues`, or delta outside (0, 1).
    """
    delta = check_unit_interval(delta, "delta")
    method = method_of(method)
    x = _losses(losses, method)[:, 0]
    mean = float(x.mean())
    lo = min(mean, 1.0 - 1e-9)
    grid = np.unique(np.concatenate([lo + (1.0 - lo) * np.linspace(0, 1, 2001) ** 2]))
    grid = grid[(grid > 0) & (grid < 1)]
    if grid.size == 0:
        return 1.0
    ok = pvalues(x, grid, method, seed) <= delta
    if not ok[-1]:
        return 1.0
    j = grid.size - int(np.argmin(ok[::-1])) if not ok.all() else 0  # first index of the passing tail
    if j == 0:
        return float(grid[0])
    a, b = float(grid[j - 1]), float(grid[j])  # a fails, b passes
    while b - a > 1e-9:
        mid = 0.5 * (a + b)
        if pvalues(x, mid, method, seed)[0] <= delta:
            b = mid
        else:
            a = mid
    return b


def min_units(epsilon: float, delta: float, method: PValue | str = PValue.BETTING) -> int:
    """Smallest number of units n at which n zero losses certify epsilon at level delta.

    Binomial and Hoeffding-Bentkus: (1 - epsilon)^n <= delta (at zero losses HB's Hoeffding-KL term is
    (1 - epsilon)^n). Hoeffding: exp(-2 n epsilon^2) <= delta. Betting: the capital after n zero losses,
    prod (1 + b_i epsilon), reaches 1/delta. Found by search against :func:`pvalues` itself, so n passes
    and n - 1 fails.

    Raises:
        ConfigError: epsilon or delta outside (0, 1), an unknown method.
    """
    return _min_units(check_unit_interval(epsilon, "epsilon"), check_unit_interval(delta, "delta"), method_of(method))


@functools.lru_cache(maxsize=64)
def _min_units(epsilon: float, delta: float, method: PValue) -> int:
    def passes(n: int) -> bool:
        return bool(pvalues(np.zeros(n), epsilon, method)[0] <= delta)

    hi = 1
    while not passes(hi):
        hi *= 2
        if hi > 1 << 24:
            raise ConfigError(f"epsilon={epsilon}, delta={delta} need more than 2^24 units with {method.value}")
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


def exceeds_pvalue(losses: np.ndarray, epsilon: float, method: PValue | str = PValue.BETTING,
                   seed: int | None = 0) -> float:
    """p-value of the opposite hypothesis, H0': mean <= epsilon (small when the mean is above epsilon): the
    test of :func:`pvalues` on the mirrored losses 1 - X against 1 - epsilon. Used to stop a test that
    cannot succeed; stopping for futility never makes a certificate wrong, it only forgoes one."""
    x = np.asarray(losses, dtype=np.float64)
    return float(pvalues(1.0 - x, 1.0 - check_unit_interval(epsilon, "epsilon"), method, seed)[0])
