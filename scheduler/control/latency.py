"""The engine's iteration time as a linear model of what the iteration does (fitted by ``smartexit profile``).

One engine step (edge/runtime/engine.py ``Engine.step``) decodes one token for every running
sequence, segment by segment, the batch shrinking as rows exit, then spends the prefill budget on
prompt chunks, one sequence per call, full depth. Its cost is a sum of per-call overheads and
per-row work, so the model is linear in :class:`StepFeatures` with non-negative coefficients
(non-negative least squares: each term is a cost, and a negative one would let the simulator
make a step cheaper by adding work).

``attention`` terms count token pairs (a row at position p attends over p cached positions in each
layer it runs); the rest count calls, rows and row-layers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edge.core.errors import ConfigError

FEATURES = ("one", "decode_calls", "decode_rows", "decode_layer_rows", "decode_attn",
            "prefill_calls", "prefill_tokens", "prefill_attn")
FORMAT = 1


@dataclass(frozen=True)
class StepFeatures:
    """What one engine iteration did.

    decode_calls: segment calls of the decode step (segments up to the deepest exit taken; 0 if none)
    decode_rows: sequences decoded; decode_layer_rows: the sum of their exit layers
    decode_attn: sum over rows of context length x layers run, in thousands
    prefill_calls: prompt chunks (each runs every segment); prefill_tokens: their tokens
    prefill_attn: sum over chunks of n x (start + n / 2) x num_layers, in thousands
    """
    decode_calls: int = 0
    decode_rows: int = 0
    decode_layer_rows: int = 0
    decode_attn: float = 0.0
    prefill_calls: int = 0
    prefill_tokens: int = 0
    prefill_attn: float = 0.0

    def vector(self) -> np.ndarray:
        """[len(FEATURES)] in FEATURES order."""
        busy = float(self.decode_rows > 0 or self.prefill_calls > 0)
        return np.array([busy, self.decode_calls, self.decode_rows, self.decode_layer_rows, self.decode_attn,
                         self.prefill_calls, self.prefill_tokens, self.prefill_attn], np.float64)


def decode_features(exit_layers: Sequence[int], contexts: Sequence[int], segment_ends: Sequence[int]) -> StepFeatures:
    """The decode part of a step: rows exiting at ``exit_layers`` with ``contexts`` cached positions.

    ``segment_ends``: the exit layers, ascending (the last is the model's depth).
    """
    if not exit_layers:
        return StepFeatures()
    deepest = max(exit_layers)
    calls = next(i for i, e in enumerate(segment_ends) if e >= deepest) + 1
    attn = sum(c * e for c, e in zip(contexts, exit_layers)) / 1e3
    return StepFeatures(decode_calls=calls, decode_rows=len(exit_layers),
                        decode_layer_rows=int(sum(exit_layers)), decode_attn=float(attn))


def prefill_features(chunks: Sequence[tuple[int, int]], num_layers: int) -> StepFeatures:
    """The prefill part of a step: ``chunks`` of (start position, tokens)."""
    return StepFeatures(prefill_calls=len(chunks), prefill_tokens=int(sum(n for _, n in chunks)),
                        prefill_attn=float(sum(n * (s + n / 2) for s, n in chunks) * num_layers / 1e3))


def combine(decode: StepFeatures, prefill: StepFeatures) -> StepFeatures:
    return StepFeatures(decode.decode_calls, decode.decode_rows, decode.decode_layer_rows, decode.decode_attn,
                        prefill.prefill_calls, prefill.prefill_tokens, prefill.prefill_attn)


@dataclass
class LatencyModel:
    """Step seconds = coef . features. ``fit`` holds how it was fitted (points, held-out error)."""

    coef: dict[str, float]
    num_layers: int
    exit_layers: list[int]
    fit: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coef]
        if missing:
            raise ConfigError(f"latency model lacks coefficient(s) {missing}: written for another feature layout")
        if any(not np.isfinite(v) or v < 0 for v in self.coef.values()):
            raise ConfigError(f"latency model coefficients must be finite and >= 0, got {self.coef}")
        if not self.exit_layers or self.exit_layers[-1] != self.num_layers:
            raise ConfigError(f"latency model: exit_layers {self.exit_layers} must end at num_layers {self.num_layers}")
        self._w = np.array([self.coef[f] for f in FEATURES], np.float64)

    def seconds(self, f: StepFeatures) -> float:
        return float(self._w @ f.vector())

    def predict(self, X: np.ndarray) -> np.ndarray:
        """[N, len(FEATURES)] -> [N] seconds."""
        return np.asarray(X, np.float64) @ self._w

    def save(self, path: str | Path) -> None:
        d = asdict(self)
        Path(path).write_text(json.dumps(d, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        """Raises ConfigError: missing file, malformed JSON, another format or feature layout."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"latency model {path}: no such file (run `smartexit profile`)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"latency model {path}: not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ConfigError(f"latency model {path}: format {d.get('format') if isinstance(d, dict) else None!r}, "
                              f"expected {FORMAT}")
        try:
            return cls(coef=dict(d["coef"]), num_layers=int(d["num_layers"]), exit_layers=list(d["exit_layers"]),
                       fit=dict(d.get("fit", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"latency model {path}: {exc!r}") from None


MIN_POINTS_PER_FEATURE = 4


def fit_latency(X: np.ndarray, y: np.ndarray, num_layers: int, exit_layers: list[int],
                groups: np.ndarray | None = None, holdout: float = 0.25, seed: int = 0) -> LatencyModel:
    """Non-negative least squares, weighted by 1/sqrt(y), of step seconds ``y`` [N] on features ``X``
    [N, F], fitted on the points outside a held-out share of ``groups`` (profile scenarios: steps of one
    scenario are correlated, so they are held out together) and scored on the rest.

    The fit's relative error is reported as the median and p90 of |pred - y| / y per held-out step,
    and the error of the mean step time per held-out scenario (what a simulator's averages see).

    Raises:
        ConfigError: fewer than ``MIN_POINTS_PER_FEATURE`` points per feature, or fewer than two
            groups (nothing to hold out).
    """
    from scipy.optimize import nnls

    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    n, k = X.shape if X.ndim == 2 else (0, len(FEATURES))
    if X.ndim != 2 or X.shape[1] != len(FEATURES) or len(y) != n:
        raise ConfigError(f"latency fit: X must be [N, {len(FEATURES)}] and y [N], got {X.shape} and {y.shape}")
    need = MIN_POINTS_PER_FEATURE * k
    if n < need:
        raise ConfigError(f"latency profile too small to fit: {n} steps, at least {need} needed "
                          f"({MIN_POINTS_PER_FEATURE} per feature x {k} features); profile longer")
    groups = np.arange(n) if groups is None else np.asarray(groups)
    uniq = np.unique(groups)
    if len(uniq) < 2:
        raise ConfigError("latency fit: the profile has one scenario; at least two are needed to hold one out")
    rng = np.random.default_rng(seed)
    held = rng.choice(uniq, size=max(1, int(round(holdout * len(uniq)))), replace=False)
    test = np.isin(groups, held)
    train = ~test
    if train.sum() < need:
        raise ConfigError(f"latency profile too small to fit: {int(train.sum())} training steps after holding out "
                          f"{int(test.sum())}, at least {need} needed")
    # scale columns so NNLS is well conditioned; coefficients are scaled back. Rows are weighted by
    # 1/sqrt(y): a step's timing noise grows with the step, and unweighted, the longest steps set every
    # coefficient (on the demo profile, 20 held-out splits, unweighted: batch-1 steps under-predicted
    # 2-3x, median step error 0.33 vs 0.17, p90 0.80 vs 0.45, worst scenario mean 0.50 vs 0.34)
    scale = np.maximum(np.abs(X[train]).max(axis=0), 1e-12)
    wt = 1.0 / np.sqrt(np.maximum(y[train], 1e-9))  # [N_train]
    w, _ = nnls(X[train] / scale * wt[:, None], y[train] * wt)
    w = w / scale
    pred = X @ w
    rel = np.abs(pred[test] - y[test]) / np.maximum(y[test], 1e-9)
    per_group = [abs(pred[groups == g].mean() - y[groups == g].mean()) / max(y[groups == g].mean(), 1e-9)
                 for g in held]
    fit = {"points": int(n), "train_points": int(train.sum()), "test_points": int(test.sum()),
           "scenarios": int(len(uniq)), "test_scenarios": int(len(held)),
           "test_rel_err_median": float(np.median(rel)), "test_rel_err_p90": float(np.quantile(rel, 0.9)),
           "test_scenario_mean_rel_err_max": float(max(per_group)),
           "test_scenario_mean_rel_err_median": float(np.median(per_group))}
    return LatencyModel(coef={f: float(v) for f, v in zip(FEATURES, w)}, num_layers=num_layers,
                        exit_layers=list(exit_layers), fit=fit)
