"""Exit-depth prediction for the serving scheduler: how deep will a running sequence's next tokens go?

A token's exit layer is one of the model's exits (3, 9 or 12 for the tiny model). Two signals:

* at admission, only the prompt: ``PromptFeatureModel``, a ridge regression from cheap prompt-id
  features to the request's mean exit layer;
* once tokens flow, the request's own recent exits: ``EmaPredictor``, an exponential moving average.

``ExitDepthPredictor`` starts from the first and hands over to the second (the EMA seeded with the prompt
model's prediction). ``evaluate_predictors`` compares them on held-out requests of the exit traces that
``smartexit profile`` writes (``<run>/scheduler/exit_traces.json``: a list of
``{"prompt_len", "prompt_ids_head", "exit_layers"}``; other keys ignored).

Everything here is pure numpy arithmetic; the scheduler keeps one float per sequence.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edge.core.errors import ConfigError

HEAD = 64   # prompt ids a trace keeps (scheduler.loadtest.profile_driver.TRACE_HEAD); features read no further, at fit or serve
FEATURES = ("log_prompt_len", "bigram_repeat_share", "unique_ratio", "mean_log1p_id", "share_below_256")
MODEL_KIND = "ridge_prompt_features"


def _fail(i: int, key: str, what: str) -> ConfigError:
    return ConfigError(f"exit trace {i}: {key!r} {what}")


def validate_traces(traces: Any) -> None:
    """Check the exit-trace format.

    Raises:
        ConfigError: not a list of objects, or a trace whose ``prompt_len`` is not an int >= 1, whose
            ``prompt_ids_head`` is not a non-empty list of ids >= 0 no longer than ``prompt_len``, or whose
            ``exit_layers`` is not a non-empty list of ints >= 0 (named by index and key).
    """
    if not isinstance(traces, (list, tuple)):
        raise ConfigError(f"exit traces: expected a list of traces, got {type(traces).__name__}")
    is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
    for i, t in enumerate(traces):
        if not isinstance(t, dict):
            raise ConfigError(f"exit trace {i}: expected an object, got {type(t).__name__}")
        for key in ("prompt_len", "prompt_ids_head", "exit_layers"):
            if key not in t:
                raise _fail(i, key, "is missing (expected prompt_len, prompt_ids_head, exit_layers)")
        if not is_int(t["prompt_len"]) or t["prompt_len"] < 1:
            raise _fail(i, "prompt_len", f"must be an int >= 1, got {t['prompt_len']!r}")
        for key in ("prompt_ids_head", "exit_layers"):
            v = t[key]
            if not isinstance(v, (list, tuple, np.ndarray)) or len(v) == 0:
                raise _fail(i, key, f"must be a non-empty list of ints, got {v!r}")
            bad = [x for x in v if not is_int(x) or x < 0]
            if bad:
                raise _fail(i, key, f"must hold ints >= 0, got {bad[0]!r}")
        if len(t["prompt_ids_head"]) > t["prompt_len"]:
            raise _fail(i, "prompt_ids_head", f"holds {len(t['prompt_ids_head'])} ids, more than prompt_len "
                        f"{t['prompt_len']}")


def read_exit_traces(path: str | Path) -> list[dict[str, Any]]:
    """The traces of an ``exit_traces.json``, validated.

    Raises:
        ConfigError: the file is missing, not JSON, or not in the trace format (the message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"exit traces {path}: no such file")
    try:
        traces = json.loads(path.read_text())
        validate_traces(traces)
    except json.JSONDecodeError as e:
        raise ConfigError(f"exit traces {path}: not JSON (line {e.lineno}: {e.msg})") from None
    except ConfigError as e:
        raise ConfigError(f"exit traces {path}: {e}") from None
    return traces


# --- per-token: exponential moving average ------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class EmaPredictor:
    """A request's next exit layer as the moving average of its exits so far; ``prior`` before any."""
    weight: float = 0.3   # share of the newest exit; 0.3 remembers about the last 1/0.3 ~ 3 tokens
    prior: float

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ConfigError(f"EMA predictor: weight must be in (0, 1], got {self.weight}")
        if not math.isfinite(self.prior):
            raise ConfigError(f"EMA predictor: prior must be finite, got {self.prior}")

    def update(self, prev_pred: float, layer: float) -> float:
        """The prediction after a token exited at ``layer``."""
        return prev_pred + self.weight * (layer - prev_pred)

    def run(self, layers: Sequence[int], start: float | None = None) -> np.ndarray:
        """[T] the prediction standing before each of ``layers`` (from ``start``, else the prior)."""
        pred = np.empty(len(layers))
        p = self.prior if start is None else start
        for i, layer in enumerate(layers):
            pred[i] = p
            p = self.update(p, layer)
        return pred


# --- at admission: ridge regression on prompt features ------------------------------------------------

def prompt_features(prompt_ids: Sequence[int], prompt_len: int | None = None) -> np.ndarray:
    """[F] features of a prompt: only its length and first ``HEAD`` ids (all a trace keeps).

    log prompt length; the share of adjacent id pairs that occurred earlier in the head (repetitiveness:
    copied spans are easy to predict; pairs, not single ids, because the share of single ids repeating an
    earlier one is exactly 1 - the unique-id ratio); the unique-id ratio; the mean log(1 + id) (a BPE
    vocabulary gives its frequent pieces small ids); the share of ids below 256 (byte-level pieces).
    """
    head = np.asarray(prompt_ids[:HEAD], dtype=np.int64)   # [H]
    if head.size == 0:
        raise ConfigError("prompt features: the prompt has no ids")
    n = len(prompt_ids) if prompt_len is None else prompt_len
    if n < head.size:
        raise ConfigError(f"prompt features: prompt_len {n} is shorter than the {head.size} ids given")
    seen, repeats = set(), 0
    for pair in zip(head[:-1].tolist(), head[1:].tolist()):
        repeats += pair in seen
        seen.add(pair)
    return np.array([math.log(n), repeats / max(1, head.size - 1), np.unique(head).size / head.size,
                     float(np.mean(np.log1p(head))), float(np.mean(head < 256))])


def _target(trace: dict[str, Any]) -> float:
    return float(np.mean(trace["exit_layers"]))


def ridge_fit(X: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge regression in closed form on standardized features, intercept unpenalized.

    Args:
        X: [N, F] features; y: [N] targets; alpha: the L2 penalty (>= 0) on standardized coefficients.

    Returns:
        (mean [F], scale [F], coef [F], intercept): predict ``intercept + ((x - mean) / scale) @ coef``;
        ``scale`` is 1 for a constant feature (its coefficient is then 0).
    """
    mean, sd = X.mean(0), X.std(0)
    scale = np.where(sd > 0, sd, 1.0)
    Z = (X - mean) / scale                                  # [N, F], centred
    intercept = float(y.mean())
    # (Z'Z + alpha I) w = Z'(y - ybar); lstsq keeps alpha = 0 with a constant feature well defined
    A = Z.T @ Z + alpha * np.eye(Z.shape[1])
    coef = np.linalg.lstsq(A, Z.T @ (y - intercept), rcond=None)[0]
    return mean, scale, coef, intercept


@dataclass
class PromptFeatureModel:
    """Ridge regression (closed form, standardized features, unpenalized intercept) from
    ``prompt_features`` to a request's mean exit layer; predictions clipped to the range seen in fit."""
    alpha: float = 1.0
    mean: np.ndarray | None = None     # [F] feature means of the fit
    scale: np.ndarray | None = None    # [F] feature standard deviations (1 where constant)
    coef: np.ndarray | None = None     # [F] on standardized features
    intercept: float = 0.0
    lo: float = -math.inf
    hi: float = math.inf

    def fit(self, traces: list[dict[str, Any]]) -> PromptFeatureModel:
        """Fit on traces (validated); returns self.

        Raises:
            ConfigError: malformed traces, fewer than 2, or alpha < 0.
        """
        validate_traces(traces)
        if len(traces) < 2:
            raise ConfigError(f"prompt model: needs at least 2 traces to fit, got {len(traces)}")
        if not self.alpha >= 0:
            raise ConfigError(f"prompt model: alpha must be >= 0, got {self.alpha}")
        X = np.stack([prompt_features(t["prompt_ids_head"], t["prompt_len"]) for t in traces])   # [N, F]
        y = np.array([_target(t) for t in traces])                                            # [N]
        self.mean, self.scale, self.coef, self.intercept = ridge_fit(X, y, self.alpha)
        self.lo, self.hi = float(y.min()), float(y.max())
        return self

    def predict_raw(self, prompt_ids: Sequence[int], prompt_len: int | None = None) -> float:
        """The regression's value, unclipped."""
        if self.coef is None:
            raise ConfigError("prompt model: not fitted (call fit or load with from_dict)")
        z = (prompt_features(prompt_ids, prompt_len) - self.mean) / self.scale
        return float(self.intercept + z @ self.coef)

    def predict(self, prompt_ids: Sequence[int], prompt_len: int | None = None) -> float:
        """The predicted mean exit layer of a prompt (full ids, or a trace's head with its ``prompt_len``)."""
        return min(self.hi, max(self.lo, self.predict_raw(prompt_ids, prompt_len)))

    def to_dict(self) -> dict[str, Any]:
        if self.coef is None:
            raise ConfigError("prompt model: not fitted, nothing to save")
        return {"kind": MODEL_KIND, "features": list(FEATURES), "head": HEAD, "alpha": self.alpha,
                "mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "intercept": self.intercept, "lo": self.lo, "hi": self.hi}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PromptFeatureModel:
        """Raises ConfigError naming the field that is missing or disagrees with this code's features."""
        if not isinstance(d, dict) or d.get("kind") != MODEL_KIND:
            raise ConfigError(f"prompt model: expected a dict with kind {MODEL_KIND!r}")
        if d.get("features") != list(FEATURES) or d.get("head") != HEAD:
            raise ConfigError(f"prompt model: saved for features {d.get('features')} over {d.get('head')} ids; "
                              f"this code computes {list(FEATURES)} over {HEAD}")
        try:
            vecs = {k: np.asarray(d[k], dtype=np.float64) for k in ("mean", "scale", "coef")}
            scalars = {k: float(d[k]) for k in ("alpha", "intercept", "lo", "hi")}
        except KeyError as e:
            raise ConfigError(f"prompt model: field {e.args[0]!r} is missing") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"prompt model: a field is not numeric ({e})") from None
        bad = [k for k, v in vecs.items() if v.shape != (len(FEATURES),)]
        if bad:
            raise ConfigError(f"prompt model: field {bad[0]!r} must hold {len(FEATURES)} numbers")
        return cls(**scalars, **vecs)


# --- combined ------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ExitDepthPredictor:
    """The prompt model's prediction at admission, then an EMA of the request's exits seeded with it."""
    prompt_model: PromptFeatureModel
    weight: float = 0.3
    _ema: EmaPredictor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ema", EmaPredictor(weight=self.weight, prior=0.0))

    def admit(self, prompt_ids: Sequence[int], prompt_len: int | None = None) -> float:
        """The prediction before any token."""
        return self.prompt_model.predict(prompt_ids, prompt_len)

    def update(self, prev_pred: float, layer: float) -> float:
        """The prediction after a token exited at ``layer``."""
        return self._ema.update(prev_pred, layer)

    def run(self, trace: dict[str, Any]) -> np.ndarray:
        """[T] the prediction standing before each token of a trace."""
        return self._ema.run(trace["exit_layers"], start=self.admit(trace["prompt_ids_head"], trace["prompt_len"]))

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "prompt_model": self.prompt_model.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExitDepthPredictor:
        """Raises ConfigError where a field is missing or malformed."""
        if not isinstance(d, dict) or "weight" not in d or "prompt_model" not in d:
            raise ConfigError("exit-depth predictor: expected a dict with 'weight' and 'prompt_model'")
        return cls(PromptFeatureModel.from_dict(d["prompt_model"]), float(d["weight"]))


# --- evaluation ----------------------------------------------------------------------------------------

MIN_FIT = len(FEATURES) + 1   # fewer training requests than coefficients: the fit is the penalty alone


def evaluate_predictors(traces: list[dict[str, Any]], holdout: float = 0.3, seed: int = 0,
                        weight: float = 0.3, alpha: float = 1.0) -> dict[str, Any]:
    """Fit on some requests, score on the others: mean absolute error in layers.

    The split is by request (a seeded permutation; ``train_ids`` / ``test_ids`` are indices into
    ``traces``, disjoint); the global mean and the prompt model see only the training requests.

    ``token_mae``: each test token's exit layer vs the prediction standing before it, over all test tokens,
    for ``global_mean`` (the training tokens' mean), ``prompt_model`` (its admission prediction, held),
    ``ema`` (the global mean as prior) and ``combined`` (``ExitDepthPredictor``).
    ``request_mae``: each test request's mean exit layer vs the admission-time prediction, for
    ``global_mean`` (the training requests' mean of means) and ``prompt_model``; at admission ``ema`` is
    its prior and ``combined`` is the prompt model, so they add nothing there.

    Raises:
        ConfigError: malformed traces, holdout outside (0, 1), or too few traces to fit and hold out.
    """
    validate_traces(traces)
    if not 0.0 < holdout < 1.0:
        raise ConfigError(f"evaluate predictors: holdout must be in (0, 1), got {holdout}")
    n = len(traces)
    n_test = int(round(holdout * n))
    if n_test < 1 or n - n_test < MIN_FIT:
        raise ConfigError(f"evaluate predictors: {n} traces with holdout {holdout} leave {n - n_test} to fit and "
                          f"{n_test} to test; need >= {MIN_FIT} to fit and >= 1 to test")
    order = np.random.default_rng(seed).permutation(n)
    test_ids, train_ids = sorted(order[:n_test].tolist()), sorted(order[n_test:].tolist())
    train, test = [traces[i] for i in train_ids], [traces[i] for i in test_ids]

    token_mean = float(np.mean(np.concatenate([t["exit_layers"] for t in train])))
    request_mean = float(np.mean([_target(t) for t in train]))
    model = PromptFeatureModel(alpha=alpha).fit(train)
    combined, ema = ExitDepthPredictor(model, weight), EmaPredictor(weight=weight, prior=token_mean)

    err = {k: [] for k in ("global_mean", "prompt_model", "ema", "combined")}
    req_err = {k: [] for k in ("global_mean", "prompt_model")}
    for t in test:
        layers = np.asarray(t["exit_layers"], dtype=np.float64)   # [T]
        admit = model.predict(t["prompt_ids_head"], t["prompt_len"])
        err["global_mean"].append(np.abs(layers - token_mean))
        err["prompt_model"].append(np.abs(layers - admit))
        err["ema"].append(np.abs(layers - ema.run(layers)))
        err["combined"].append(np.abs(layers - combined.run(t)))
        req_err["global_mean"].append(abs(layers.mean() - request_mean))
        req_err["prompt_model"].append(abs(layers.mean() - admit))
    return {
        "requests": {"train": len(train), "test": len(test)},
        "tokens": {"train": int(sum(len(t["exit_layers"]) for t in train)),
                   "test": int(sum(len(t["exit_layers"]) for t in test))},
        "train_ids": train_ids, "test_ids": test_ids,
        "global_mean": {"token": token_mean, "request": request_mean},
        "token_mae": {k: float(np.mean(np.concatenate(v))) for k, v in err.items()},
        "request_mae": {k: float(np.mean(v)) for k, v in req_err.items()},
        "holdout": holdout, "seed": seed, "weight": weight, "alpha": alpha,
        "prompt_model": model.to_dict(),
    }
