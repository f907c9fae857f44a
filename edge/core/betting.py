"""The certificate's betting test, one unit at a time (calibration.pvalues runs it over a sample; the serving
host's audit runs it on live requests, edge/runtime/audit.py): H0: the mean unit loss in [0, 1] exceeds
epsilon, tested by a nonnegative supermartingale (the capital K_t of betting against H0, Waudby-Smith &
Ramdas 2024), whose p-value min(1, 1 / max_t K_t) is anytime-valid by Ville's inequality.

Here, below calibration and the runtime both, so that the served audit computes exactly the test that
certified the table.
"""
from __future__ import annotations

import numpy as np

# The betting strategy, fixed a priori. The largest bet that keeps the capital positive for any
# X in [0, 1] is 1 / (1 - epsilon); bets are truncated at BET_FRACTION of it (WSR 2024, sec. 5, truncate
# the aGRAPA bet at c < 1), so that a unit whose every token is a false exit costs a factor
# 1 - BET_FRACTION instead of all the capital. Per-prompt false-exit rates are small, so the
# growth-optimal bet exceeds the ceiling and the truncation binds: c near 1 loses little growth.
BET_FRACTION = 0.9
# Prior of the running mean / variance estimates (weight one unit): a unit of one token at rate epsilon/2.
PRIOR_WEIGHT = 1.0


class Betting:
    """The betting test of H0: mean > epsilon, one unit at a time (anytime-valid: Ville's inequality bounds the
    capital's supremum, so the test may be read after every unit, and a server may run it on live traffic).
    ``epsilon``: a scalar or one per hypothesis [G]; ``p_value`` = min(1, 1 / max_t K_t) per hypothesis."""

    def __init__(self, epsilon: float | np.ndarray, prior_mean: float | None = None) -> None:
        """``prior_mean``: the running mean's prior (weight one unit); None: epsilon / 2, a unit inside H0's
        complement, so the first bets are small."""
        self.epsilon = np.atleast_1d(np.asarray(epsilon, dtype=np.float64)).copy()  # [G]
        self._cap = BET_FRACTION / (1.0 - self.epsilon)
        mu0 = self.epsilon / 2 if prior_mean is None else np.full_like(self.epsilon, prior_mean)
        self._s_mean = PRIOR_WEIGHT * mu0  # running sums with the prior folded in, [G]
        self._s_var = PRIOR_WEIGHT * mu0 * (1 - mu0)
        self._log_k = np.zeros_like(self.epsilon)
        self._best = np.zeros_like(self.epsilon)
        self.n = 0

    def update(self, xt: float | np.ndarray) -> None:
        """One unit's loss in [0, 1] (a scalar, or one per hypothesis)."""
        w = PRIOR_WEIGHT + self.n
        mu, var = self._s_mean / w, self._s_var / w  # predictable: from units before this one only
        gap = self.epsilon - mu
        bet = np.minimum(np.maximum(gap / (var + gap * gap), 0.0), self._cap)  # aGRAPA: argmax of the 2nd-order growth
        self._log_k = self._log_k + np.log1p(bet * (self.epsilon - xt))
        self._best = np.maximum(self._best, self._log_k)
        self._s_var = self._s_var + (xt - mu) ** 2
        self._s_mean = self._s_mean + xt
        self.n += 1

    @property
    def p_value(self) -> np.ndarray:
        return np.minimum(1.0, np.exp(-self._best))
