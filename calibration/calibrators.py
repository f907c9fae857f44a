"""Per-exit calibrators: signals [N, F] -> P(exit's token == full model's token).

Three kinds (:class:`CalibratorKind`):

- ``platt``: logistic regression on all standardised signals (Platt 1999,
  "Probabilistic outputs for support vector machines"); score = the logit.
- ``isotonic``: the Platt score recalibrated by isotonic regression
  (Zadrozny & Elkan 2002, "Transforming classifier scores into accurate
  multiclass probability estimates"); order-preserving, so it ranks tokens
  exactly as Platt does.
- ``maxprob``: isotonic map of the softmax top-1 probability alone, the
  CALM-style baseline (Schuster et al. 2022).
- ``mlp``: a one-hidden-layer ReLU network on the standardised signals (SpecEE's
  per-layer predictor, Xu et al., ISCA 2025, smaller: 16 units) trained with the
  log-loss, score = its logit, probability = its sigmoid (the network's own
  estimate, Platt-style). The candidate checks' features interact (the lookup
  agreeing matters when the top candidate's logit is high), which a linear score
  cannot express. No isotonic step on top: its flat blocks made the threshold
  path coarse, so Learn-then-Test had to take a whole block of tokens at once and
  stopped early (measured on the bundled model: at lambda 0.980 with 0.06% risk,
  where the next block failed); the sigmoid moves smoothly.

Fitting uses scikit-learn; a fitted calibrator is a handful of numbers
(:meth:`Calibrator.to_dict`) and predicts with plain numpy, so deployment
needs no scikit-learn. Each score's arithmetic is in its own module
(:mod:`calibration.platt`, :mod:`calibration.isotonic`,
:mod:`calibration.mlp_score`); metrics (ECE, Brier, reliability curve) are
pure functions in :mod:`calibration.metrics`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from calibration.isotonic import fit_isotonic, isotonic_probability, isotonic_threshold
from calibration.mlp_score import FitPool, MlpJob, MlpParams, fit_mlp, fit_mlps, mlp_score, mlp_score_form
from calibration.platt import fit_logistic, sigmoid, sigmoid_threshold
from edge.runtime.rules import TOP1
from edge.core.errors import ConfigError


class CalibratorKind(str, enum.Enum):
    PLATT = "platt"
    ISOTONIC = "isotonic"
    MAXPROB = "maxprob"
    MLP = "mlp"


def _kind(kind: CalibratorKind | str) -> CalibratorKind:
    try:
        return CalibratorKind(kind)
    except ValueError:
        raise ConfigError(f"unknown calibrator kind {kind!r}; expected one of "
                          f"{[k.value for k in CalibratorKind]}") from None


def _moments(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean [F], std [F]) that standardise X [N, F]; a constant signal is left unscaled (std 1)."""
    sd = X.std(axis=0)  # [F]
    return X.mean(axis=0), np.where(sd > 1e-12, sd, 1.0)


def _check_xy(X: Any, y: Any | None, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate features [N, F] (and 0/1 targets [N]); return float64 copies."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ConfigError(f"{what}: features must be 2-D [N, F], got shape {X.shape}")
    if X.shape[0] == 0:
        raise ConfigError("empty split: no tokens")
    if not np.isfinite(X).all():
        raise ConfigError(f"{what}: features contain NaN or infinite values")
    if y is None:
        return X, None
    y = np.asarray(y)
    if y.shape != (X.shape[0],):
        raise ConfigError(f"{what}: targets must have shape ({X.shape[0]},), got {y.shape}")
    y = y.astype(np.float64)
    if not np.isin(y, (0.0, 1.0)).all():
        raise ConfigError(f"{what}: targets must be 0/1 (1 = exit agrees with the last exit)")
    return X, y


@dataclass
class Calibrator:
    """One exit's calibrator. Fit with :meth:`fit`; all fitted state is plain numbers.

    Fields after fitting: ``mean``/``std`` [F] standardise the signals,
    ``coef`` [F] and ``intercept`` give the Platt logit, ``iso_x``/``iso_y`` [T]
    are the isotonic knots (isotonic, maxprob), ``constant`` is set instead
    when the training targets were all 0 or all 1.
    """

    kind: CalibratorKind = CalibratorKind.ISOTONIC
    C: float = 1.0  # inverse L2 strength of the logistic regression (sklearn default)
    n_features: int = 0
    mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    std: np.ndarray = field(default_factory=lambda: np.ones(0))
    coef: np.ndarray = field(default_factory=lambda: np.zeros(0))
    intercept: float = 0.0
    iso_x: np.ndarray = field(default_factory=lambda: np.zeros(0))
    iso_y: np.ndarray = field(default_factory=lambda: np.zeros(0))
    constant: float | None = None
    fitted: bool = False
    # mlp kind: hidden layer [F, H] and [H], output [H] and scalar, on the standardised signals
    w1: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    b1: np.ndarray = field(default_factory=lambda: np.zeros(0))
    w2: np.ndarray = field(default_factory=lambda: np.zeros(0))
    b2: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.kind = _kind(self.kind)
        if not self.C > 0:
            raise ConfigError(f"calibrator C must be > 0, got {self.C}")

    # ----------------------------------------------------------------- fit
    def fit(self, X: np.ndarray, y: np.ndarray, mlp: MlpParams | None = None) -> "Calibrator":
        """Fit on signals X [N, F] and targets y [N] (1 = correct exit); returns self. ``mlp``: the mlp kind's
        network already fitted on :meth:`mlp_job`'s inputs (:func:`fit_calibrator_sets` fits them in processes),
        None: fitted here.

        Raises:
            ConfigError: bad shapes, NaN/inf features, non-binary targets,
                maxprob with no top1_prob column.
        """
        X, y = _check_xy(X, y, f"{self.kind.value} calibrator fit")
        f = X.shape[1]
        if self.kind is CalibratorKind.MAXPROB and f <= TOP1:
            raise ConfigError(f"maxprob calibrator needs column {TOP1} (top1_prob); got F={f}")
        self.n_features = f
        self.mean, self.std = _moments(X)
        self.coef, self.intercept = np.zeros(f), 0.0
        self.iso_x, self.iso_y = np.zeros(0), np.zeros(0)
        self.constant = None
        rate = float(y.mean())
        if rate in (0.0, 1.0):  # degenerate targets: nothing to learn, predict the rate
            self.constant = rate
            self.fitted = True
            return self
        if self.kind is CalibratorKind.MLP:
            self.w1, self.b1, self.w2, self.b2 = mlp if mlp is not None else fit_mlp((X - self.mean) / self.std, y,
                                                                                      self.seed)
        elif self.kind is not CalibratorKind.MAXPROB:
            self.coef, self.intercept = fit_logistic((X - self.mean) / self.std, y, self.C)
        self.fitted = True
        if self.kind not in (CalibratorKind.PLATT, CalibratorKind.MLP):
            self.iso_x, self.iso_y = fit_isotonic(self.score(X), y)
        return self

    def isotonic_over(self, X: np.ndarray, y: np.ndarray) -> "Calibrator":
        """The isotonic calibrator :meth:`fit` would give on (X, y), from this Platt calibrator fitted on the
        same (X, y): the same standardisation and logistic regression, isotonic regression on its score. One
        logistic fit for both kinds (the report compares them side by side).

        Raises:
            ConfigError: this is not a fitted Platt calibrator of X's width.
        """
        if self.kind is not CalibratorKind.PLATT or not self.fitted:
            raise ConfigError(f"isotonic_over needs a fitted platt calibrator, this is a "
                              f"{'fitted' if self.fitted else 'unfitted'} {self.kind.value} one")
        X, y = _check_xy(X, y, "isotonic calibrator fit")
        if X.shape[1] != self.n_features:
            raise ConfigError(f"platt calibrator was fitted on F={self.n_features} signals, got F={X.shape[1]}")
        out = Calibrator(kind=CalibratorKind.ISOTONIC, C=self.C, n_features=self.n_features, mean=self.mean.copy(),
                         std=self.std.copy(), coef=self.coef.copy(), intercept=self.intercept, constant=self.constant,
                         fitted=True, seed=self.seed)
        if out.constant is None:
            out.iso_x, out.iso_y = fit_isotonic(out.score(X), y)
        return out

    # ------------------------------------------------------------- predict
    def _check_fitted(self, X: np.ndarray) -> np.ndarray:
        if not self.fitted:
            raise ConfigError(f"{self.kind.value} calibrator is not fitted; call fit() first")
        X, _ = _check_xy(X, None, f"{self.kind.value} calibrator")
        if X.shape[1] != self.n_features:
            raise ConfigError(f"{self.kind.value} calibrator was fitted on F={self.n_features} signals, "
                              f"got F={X.shape[1]}")
        return X

    def score(self, X: np.ndarray) -> np.ndarray:
        """Raw 1-D score s [N]; :meth:`predict` is monotone non-decreasing in it.

        Platt and isotonic: the logistic logit w.((x - mean) / std) + b. Maxprob:
        the top1_prob column.
        """
        X = self._check_fitted(X)  # [N, F]
        if self.kind is CalibratorKind.MAXPROB:
            return X[:, TOP1].copy()
        z = (X - self.mean) / self.std
        if self.kind is CalibratorKind.MLP and self.constant is None:
            return mlp_score(z, self.w1, self.b1, self.w2, self.b2)  # [N]
        return z @ self.coef + self.intercept  # [N] (a constant mlp calibrator: 0)

    def score_form(self):
        """:meth:`score` as an :class:`edge.runtime.rules.ScoreForm` on the raw signals (standardisation
        folded into the first layer): what a candidate-shortlist graph computes per token."""
        from edge.runtime.rules import ScoreForm

        if not self.fitted:
            raise ConfigError(f"{self.kind.value} calibrator is not fitted")
        if self.kind is not CalibratorKind.MLP or self.constant is not None:
            return ScoreForm.linear(*self.linear_score())
        return mlp_score_form(self.mean, self.std, self.w1, self.b1, self.w2, self.b2)

    def linear_score(self) -> tuple[np.ndarray, float]:
        """(w [F], b) such that ``score(X) == X @ w + b``: the runtime form of the rule, one dot product
        per token with no standardisation pass (constant calibrators give w = 0, b = 0)."""
        if not self.fitted:
            raise ConfigError(f"{self.kind.value} calibrator is not fitted")
        if self.kind is CalibratorKind.MAXPROB:
            w = np.zeros(self.n_features)
            w[TOP1] = 1.0
            return w, 0.0
        if self.kind is CalibratorKind.MLP:
            if self.constant is not None:
                return np.zeros(self.n_features), 0.0
            raise ConfigError("an mlp calibrator's score is not linear in the signals: use score_form()")
        w = self.coef / self.std  # [F]
        return w, float(self.intercept - self.mean @ w)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Calibrated probability p [N] in [0, 1] that this exit's token is the full model's."""
        return self.probability(self.score(X))

    def probability(self, s: np.ndarray) -> np.ndarray:
        """Calibrated probability [N] from raw scores s [N] (:meth:`score`, or ``X @ w + b`` with
        :meth:`linear_score`'s w, b: what a runtime computes per token, without :meth:`predict`'s checks)."""
        if self.constant is not None:
            return np.full(np.shape(s), self.constant)
        if self.kind in (CalibratorKind.PLATT, CalibratorKind.MLP):
            return sigmoid(s)
        return isotonic_probability(s, self.iso_x, self.iso_y)

    def score_threshold(self, lam: float) -> float:
        """Smallest raw score s with predict(s) >= lam (+inf if none): the raw-signal rule.

        A runtime without the calibrator exits when ``score(x) >= score_threshold(lam)``,
        which is the same decision as ``predict(x) >= lam`` because predict is monotone
        non-decreasing (and piecewise linear between isotonic knots).
        """
        if not self.fitted:
            raise ConfigError(f"{self.kind.value} calibrator is not fitted")
        if self.constant is not None:
            return -np.inf if self.constant >= lam else np.inf
        if self.kind in (CalibratorKind.PLATT, CalibratorKind.MLP):
            return sigmoid_threshold(lam)
        return isotonic_threshold(self.iso_x, self.iso_y, lam)

    # -------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable parameters; :meth:`from_dict` rebuilds an identical predictor."""
        if not self.fitted:
            raise ConfigError(f"{self.kind.value} calibrator is not fitted; nothing to serialise")
        return {
            "kind": self.kind.value,
            "C": float(self.C),
            "n_features": int(self.n_features),
            "mean": [float(v) for v in self.mean],
            "std": [float(v) for v in self.std],
            "coef": [float(v) for v in self.coef],
            "intercept": float(self.intercept),
            "iso_x": [float(v) for v in self.iso_x],
            "iso_y": [float(v) for v in self.iso_y],
            "constant": None if self.constant is None else float(self.constant),
            **({"w1": self.w1.tolist(), "b1": self.b1.tolist(), "w2": self.w2.tolist(), "b2": float(self.b2)}
               if self.kind is CalibratorKind.MLP else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibrator":
        """Rebuild a fitted calibrator from :meth:`to_dict` output (no scikit-learn needed).

        Raises:
            ConfigError: a missing field or arrays of the wrong length.
        """
        need = ("kind", "n_features", "mean", "std", "coef", "intercept", "iso_x", "iso_y", "constant")
        missing = [k for k in need if k not in d]
        if missing:
            raise ConfigError(f"calibrator dict is missing fields {missing}")
        f = int(d["n_features"])
        cal = cls(kind=d["kind"], C=float(d.get("C", 1.0)), n_features=f,
                  mean=np.asarray(d["mean"], dtype=np.float64), std=np.asarray(d["std"], dtype=np.float64),
                  coef=np.asarray(d["coef"], dtype=np.float64), intercept=float(d["intercept"]),
                  iso_x=np.asarray(d["iso_x"], dtype=np.float64), iso_y=np.asarray(d["iso_y"], dtype=np.float64),
                  constant=None if d["constant"] is None else float(d["constant"]), fitted=True)
        if cal.kind is CalibratorKind.MLP and cal.constant is None:
            try:
                cal.w1, cal.b1 = np.asarray(d["w1"], np.float64), np.asarray(d["b1"], np.float64)
                cal.w2, cal.b2 = np.asarray(d["w2"], np.float64), float(d["b2"])
            except KeyError as exc:
                raise ConfigError(f"mlp calibrator dict is missing {exc}") from None
            h = cal.b1.shape[0]
            if cal.w1.shape != (f, h) or cal.w2.shape != (h,):
                raise ConfigError(f"mlp calibrator dict: w1 {cal.w1.shape}, b1 {cal.b1.shape}, w2 {cal.w2.shape} do "
                                  f"not fit {f} signals")
        for name in ("mean", "std", "coef"):
            if getattr(cal, name).shape != (f,):
                raise ConfigError(f"calibrator dict field {name!r} must have {f} entries, "
                                  f"got {getattr(cal, name).shape}")
        if cal.iso_x.shape != cal.iso_y.shape:
            raise ConfigError(f"calibrator dict: iso_x {cal.iso_x.shape} and iso_y {cal.iso_y.shape} differ")
        if cal.constant is None and cal.kind not in (CalibratorKind.PLATT, CalibratorKind.MLP) and cal.iso_x.size == 0:
            raise ConfigError(f"calibrator dict: {cal.kind.value} calibrator has no isotonic knots")
        return cal


def fit_calibrators(signals: dict[int, np.ndarray], targets: dict[int, np.ndarray],
                    kind: CalibratorKind | str = CalibratorKind.ISOTONIC, C: float = 1.0,
                    seed: int = 0, pool: FitPool | None = None) -> dict[int, Calibrator]:
    """Fit one calibrator per exit except the last (never a decision point).

    Args:
        signals: exit layer -> signals [N, F], every exit (:func:`calibration.signals.signals_all_exits`).
        targets: decision exit (every exit but the last) -> 0/1 [N] (:func:`calibration.signals.exit_targets`).
        kind: calibrator kind.
        C: inverse L2 strength of the logistic regression.
        pool: processes for the mlp kind's networks (:func:`calibration.mlp_score.fit_pool`); the same
            calibrators, sooner.

    Returns:
        exit layer -> fitted :class:`Calibrator`, for every exit but the last.

    Raises:
        ConfigError: keys that differ, fewer than 2 exits, or bad arrays.
    """
    return fit_calibrator_sets([(signals, targets)], kind, C, seed, pool)[0]


def fit_calibrator_sets(sets: list[tuple[dict[int, np.ndarray], dict[int, np.ndarray]]],
                        kind: CalibratorKind | str = CalibratorKind.ISOTONIC, C: float = 1.0, seed: int = 0,
                        pool: FitPool | None = None) -> list[dict[int, Calibrator]]:
    """:func:`fit_calibrators` of each (signals, targets) of ``sets``; the mlp kind's networks of all of them
    fitted together, in ``pool``'s processes when given (cross-fitting's folds: one round of the pool).

    Raises:
        ConfigError: as :func:`fit_calibrators`, for any set.
    """
    kind = _kind(kind)
    for signals, targets in sets:
        layers = sorted(signals)
        if len(layers) < 2:
            raise ConfigError(f"fit_calibrators: need at least 2 exits (the last is never a decision point), "
                              f"got {layers}")
        if sorted(targets) != layers[:-1]:
            raise ConfigError(f"fit_calibrators: target exits {sorted(targets)} are not the decision exits "
                              f"{layers[:-1]} of signal exits {layers}")
    problems = [(i, k) for i, (signals, _) in enumerate(sets) for k in sorted(signals)[:-1]]
    nets: dict[tuple[int, int], MlpParams] = {}
    if kind is CalibratorKind.MLP:
        jobs = {(i, k): _mlp_job(sets[i][0][k], sets[i][1][k], seed) for i, k in problems}
        jobs = {key: job for key, job in jobs.items() if job is not None}
        nets = dict(zip(jobs, fit_mlps(list(jobs.values()), pool)))
    out: list[dict[int, Calibrator]] = [{} for _ in sets]
    for i, k in problems:
        out[i][k] = Calibrator(kind=kind, C=C, seed=seed).fit(sets[i][0][k], sets[i][1][k], nets.get((i, k)))
    return out


def _mlp_job(X: Any, y: Any, seed: int) -> MlpJob | None:
    """The network fit :meth:`Calibrator.fit` of the mlp kind does on (X, y): (standardised X, y, seed); None for
    degenerate targets (nothing is fitted)."""
    X, y = _check_xy(X, y, "mlp calibrator fit")
    if float(y.mean()) in (0.0, 1.0):
        return None
    mean, std = _moments(X)
    return (X - mean) / std, y, seed
