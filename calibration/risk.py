"""Learn-then-Test over units: the loosest threshold whose mean per-unit false-exit rate is certified.

A *unit* is what is exchangeable: one prompt drawn i.i.d. from the calibration
corpus and continued by the engine. Tokens of one unit are correlated (they
share a document and a generated prefix), so the evidence is the number of
units, not of tokens. The risk of a threshold lambda is
R(lambda) = E[per-unit false-exit rate], a mean of [0, 1]-bounded losses.

R is not monotone in lambda (a looser threshold can move a token's exit from a
wrong to a right layer), so we use Learn then Test (Angelopoulos, Bates,
Candes, Jordan, Lei 2021, "Learn then Test: Calibrating Predictive Algorithms
to Achieve Risk Control"): on a grid of thresholds fixed before the certify
units are seen, test H0: R(lambda) > epsilon with a valid p-value
(:mod:`calibration.pvalues`), walking from strict to loose (fixed-sequence
testing) and stopping at the first non-rejection. The family-wise error is
<= delta with no multiplicity correction, whatever the dependence between the
tests (LTT Prop. 3; CALM, Schuster et al. 2022, sec. 3), so
P[R(chosen lambda) > epsilon] <= delta over the draw of the certify units. The
score (the calibrators) must be fixed before those units are drawn: a score
fitted on the same data certifies nothing (isotonic regression's top blocks
have in-sample accuracy exactly 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from calibration.pvalues import PValue, check_unit_interval, method_of, min_units, pvalues
from edge.core.errors import ConfigError

NEVER_EXIT: float = 2.0  # chosen lambda when even the strictest candidate fails: no p in [0, 1] reaches it
DEFAULT_GRID_SIZE = 1001  # lambda = 1.000, 0.999, ..., 0.000


def default_grid(size: int = DEFAULT_GRID_SIZE) -> np.ndarray:
    """Thresholds 1.0 -> 0.0 in equal steps, strict to loose.

    Fixed in advance rather than taken from quantiles of the calibration
    probabilities: fixed-sequence testing needs the order of hypotheses chosen
    before seeing the data (LTT sec. 4).
    """
    return np.linspace(1.0, 0.0, size)


@dataclass
class Walk:
    """Outcome of the fixed-sequence walk.

    ``index`` is the position in the grid of the chosen (last rejected) threshold, -1 when even
    the first failed (then ``lam`` is :data:`NEVER_EXIT`). ``tested`` holds (lambda, mean unit
    loss, p-value) of every hypothesis tested, in order; the last is the first failure, if any.
    """

    lam: float
    index: int
    n_units: int
    epsilon: float
    delta: float
    method: PValue
    seed: int
    tested: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def certified(self) -> bool:
        """True when some real threshold passed (tokens may exit)."""
        return self.index >= 0

    @property
    def completed(self) -> bool:
        """True when every hypothesis of the grid was rejected (the walk reached its last threshold)."""
        return self.certified and len(self.tested) == self.index + 1 and self.tested[-1][2] <= self.delta

    def to_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam, "index": self.index, "n_units": self.n_units, "epsilon": self.epsilon,
                "delta": self.delta, "pvalue": self.method.value, "order_seed": self.seed,
                "certified": self.certified, "completed": self.completed,
                "tested": [list(t) for t in self.tested]}


def learn_then_test(losses: np.ndarray, lams: np.ndarray, epsilon: float, delta: float = 0.05,
                    method: PValue | str = PValue.BETTING, seed: int = 0) -> Walk:
    """Fixed-sequence test of H0: R(lams[j]) > epsilon for j = 0, 1, ... until the first non-rejection.

    Args:
        losses: per-unit losses [U, G] in [0, 1]; column j belongs to ``lams[j]``.
        lams: the thresholds [G], strictly decreasing (strict to loose), fixed before the data.
        epsilon: tolerated mean per-unit false-exit rate, in (0, 1).
        delta: probability that the certificate is wrong, in (0, 1).
        method: p-value, see :class:`calibration.pvalues.PValue`.
        seed: the random order of the units for the betting p-value.

    Returns:
        :class:`Walk`.

    Raises:
        ConfigError: epsilon or delta outside (0, 1); fewer units than
            :func:`calibration.pvalues.min_units` (no threshold could ever pass); a grid that is not
            strictly decreasing, empty or non-finite; losses of the wrong shape or outside [0, 1].
    """
    epsilon = check_unit_interval(epsilon, "epsilon")
    delta = check_unit_interval(delta, "delta")
    method = method_of(method)
    lams = np.asarray(lams, dtype=np.float64)
    if lams.ndim != 1 or lams.size == 0 or not np.isfinite(lams).all() or (np.diff(lams) >= 0).any():
        raise ConfigError(f"learn_then_test: the grid must be a non-empty, finite, strictly decreasing 1-D array "
                          f"(strict to loose), got shape {lams.shape}")
    losses = np.asarray(losses, dtype=np.float64)
    if losses.ndim != 2 or losses.shape[1] != lams.size:
        raise ConfigError(f"learn_then_test: losses must be [U, G={lams.size}], got shape {losses.shape}")
    n = losses.shape[0]
    need = min_units(epsilon, delta, method)
    if n < need:
        raise ConfigError(f"learn_then_test: {n} units cannot certify epsilon={epsilon} at delta={delta} with the "
                          f"{method.value} p-value; need at least {need} units (even with zero false exits)")
    pv = pvalues(losses, epsilon, method, seed)  # [G]
    passed = pv <= delta
    n_pass = lams.size if passed.all() else int(np.argmin(passed))  # index of the first failure
    n_tested = min(n_pass + 1, lams.size)
    mean = losses.mean(axis=0)
    tested = [(float(lams[i]), float(mean[i]), float(pv[i])) for i in range(n_tested)]
    index = n_pass - 1
    lam = float(lams[index]) if index >= 0 else NEVER_EXIT
    return Walk(lam=lam, index=index, n_units=n, epsilon=epsilon, delta=delta, method=method, seed=seed, tested=tested)
