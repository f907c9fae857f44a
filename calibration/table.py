"""The threshold table (``thresholds.json``) and the exit rule that applies it.

The table is bound to one multi-exit checkpoint by the sha256 of its folder;
loading it against another checkpoint is an error that shows both hashes.
Per exit layer it holds the calibrator (so the calibrated probability can be
recomputed) and the equivalent raw-score threshold, so a runtime can decide
with plain arithmetic on the exit signals.

Version 2 (this one) adds ``kv_mode``: the K/V mode of skipped layers the
certificate covers (a table certified with ``defer`` says nothing about
``propagate``), and certificates over units (prompts) instead of tokens.
Version 1 tables were certified on the tokens their calibrators were fitted
on, which certifies nothing; they are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calibration.calibrators import Calibrator, CalibratorKind
from calibration.signals import GATED_SIGNAL_NAMES, SIGNAL_NAMES, gated_signals, signals_from_stats
from edge.model.candidates import CANDIDATE_SIGNAL_NAMES, is_signal_names, lookup_feature
from edge.core.artifacts import atomic_write_json, sha256_path
from edge.core.errors import ArtifactError, ConfigError
from edge.runtime.rules import ScoreForm
from edge.runtime.settings import EPSILON

TABLE_VERSION = 2


@dataclass
class ThresholdTable:
    checkpoint_sha256: str
    exit_layers: list[int]  # all exits, the last is the full model
    calibrator_kind: str
    lam: float  # threshold on the calibrated probability (shared by all decision exits)
    score_thresholds: dict[int, float]  # decision exit -> raw-score threshold
    calibrators: dict[int, Calibrator]
    certificate: dict[str, Any] = field(default_factory=dict)  # epsilon, delta, n, empirical rate, bound, ...
    signal_names: tuple[str, ...] = SIGNAL_NAMES
    kv_mode: str = "defer"  # the K/V mode of skipped layers the certificate covers
    # candidate-shortlist models: rows whose context lookup matched fewer than this many tokens run every layer
    # with no check (part of the rule the certificate covers; 0: every row is checked)
    route_min_lookup: int = 0
    # the corpus n-gram table (sha256 of the export's ngram.npz) the context lookup falls back to where the
    # context's match is short (edge/model/lookup.py); None: the context alone. Part of the certified rule
    lookup_table_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.kv_mode not in ("defer", "propagate"):
            raise ConfigError(f"threshold table kv_mode must be 'defer' or 'propagate', got {self.kv_mode!r}")

    @property
    def epsilon(self) -> float:
        """The false-exit rate the certificate was calibrated for (the run's recorded
        :data:`edge.runtime.settings.EPSILON`): what every reader of a table uses, the online audit included.

        Raises:
            ConfigError: the certificate records no valid ``epsilon``.
        """
        if "epsilon" not in self.certificate:
            raise ConfigError("threshold table: its certificate records no 'epsilon' (keys: "
                              f"{sorted(self.certificate)}); re-run `smartexit calibrate`")
        return EPSILON.check(self.certificate["epsilon"], "threshold table certificate")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": TABLE_VERSION,
            "checkpoint_sha256": self.checkpoint_sha256,
            "exit_layers": self.exit_layers,
            "signal_names": list(self.signal_names),
            "calibrator_kind": self.calibrator_kind,
            "lambda": self.lam,
            "kv_mode": self.kv_mode,
            "route_min_lookup": self.route_min_lookup,
            "lookup_table_sha256": self.lookup_table_sha256,
            **self.certificate,
            "layers": {
                str(k): {"score_threshold": _finite_or_str(self.score_thresholds[k]),
                         "calibrator": self.calibrators[k].to_dict()}
                for k in self.exit_layers[:-1]
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "thresholds.json") -> "ThresholdTable":
        try:
            if d["version"] != TABLE_VERSION:
                raise ConfigError(f"{source}: threshold table version {d['version']} is not {TABLE_VERSION}; "
                                  + ("version 1 tables were certified on the tokens their calibrators were fitted "
                                     "on and name no K/V mode; " if d["version"] == 1 else "")
                                  + "re-run `smartexit calibrate`")
            layers = [int(k) for k in d["exit_layers"]]
            per = {int(k): v for k, v in d["layers"].items()}
            cert_keys = [k for k in d if k not in ("version", "checkpoint_sha256", "exit_layers", "signal_names",
                                                   "calibrator_kind", "lambda", "layers", "kv_mode", "route_min_lookup",
                                                   "lookup_table_sha256")]
            return cls(
                checkpoint_sha256=d["checkpoint_sha256"], exit_layers=layers, calibrator_kind=d["calibrator_kind"],
                lam=float(d["lambda"]),
                score_thresholds={k: float(v["score_threshold"]) for k, v in per.items()},
                calibrators={k: Calibrator.from_dict(v["calibrator"]) for k, v in per.items()},
                certificate={k: d[k] for k in cert_keys}, signal_names=tuple(d["signal_names"]),
                kv_mode=d["kv_mode"], route_min_lookup=int(d.get("route_min_lookup", 0)),
                lookup_table_sha256=d.get("lookup_table_sha256"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed threshold table ({exc!r})") from exc

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())


def _finite_or_str(x: float) -> float | str:
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf")


def _fold(b: float, threshold: float) -> float:
    """A bias with the score threshold moved into it (an infinite threshold: never / always exit)."""
    if np.isinf(threshold):
        return -1e30 if threshold > 0 else 1e30
    return float(b) - float(threshold)


def load_table(path: str | Path, checkpoint: str | Path) -> ThresholdTable:
    """Load ``thresholds.json`` and check it was calibrated for ``checkpoint``.

    Raises:
        ArtifactError: the table was calibrated for a different checkpoint (both hashes shown).
        ConfigError: a missing or malformed table.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"threshold table {path} does not exist (run `smartexit calibrate`)")
    try:
        table = ThresholdTable.from_dict(json.loads(path.read_text()), source=str(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    actual = sha256_path(checkpoint)
    if actual != table.checkpoint_sha256:
        raise ArtifactError(
            f"{path} was calibrated for checkpoint sha256 {table.checkpoint_sha256}, but {checkpoint} has "
            f"sha256 {actual}; re-run `smartexit calibrate` for this checkpoint"
        )
    return table


def _shown(names, most: int = 12) -> str:
    """Signal names for an error message: the first ``most`` and how many there are (a candidate check's
    table has 9 + D, its exit hidden's columns among them)."""
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


class TableRule:
    """Exit rule that applies a threshold table (the engine's and the reference generator's rule).

    The calibrator's raw score is linear in the signals (:meth:`Calibrator.linear_score`), so the rule
    at a decision exit is ``features @ w + b >= 0`` with the table's threshold folded into ``b``
    (equivalent to calibrated probability >= lambda). The engine has the segment graphs compute that
    score (:meth:`linear`); :meth:`decide` (softmax signals) and :meth:`decide_gated` (a model with exit
    gates, signals :data:`calibration.signals.GATED_SIGNAL_NAMES`) compute it on the host from the
    signals of :mod:`calibration.signals`, for a caller that asks instead (the reference generator).
    """

    def __init__(self, table: ThresholdTable) -> None:
        names = tuple(table.signal_names)
        self.candidates = is_signal_names(names)
        if names not in (SIGNAL_NAMES, GATED_SIGNAL_NAMES) and not self.candidates:
            raise ConfigError(f"threshold table signals [{_shown(names)}] are not this version's {list(SIGNAL_NAMES)} "
                              f"(or {list(GATED_SIGNAL_NAMES)} for a model with exit gates, "
                              f"{list(CANDIDATE_SIGNAL_NAMES)} and exit_hidden_0 .. exit_hidden_<D-1> for one "
                              f"with a candidate shortlist); re-run `smartexit calibrate`")
        self.table = table
        self.gated = names == GATED_SIGNAL_NAMES
        # the engine checks only rows whose context lookup feature reaches this (edge.runtime.exit_step)
        self.route_min_lookup = float(lookup_feature(np.array(table.route_min_lookup))) if self.candidates else 0.0
        # the corpus table the context lookup falls back to (its sha256; None: the context alone)
        self.lookup_table_sha256 = table.lookup_table_sha256 if self.candidates else None
        self._m = len(table.exit_layers)
        # per decision exit: the rule as a ScoreForm (the calibrator's score, threshold folded in)
        self._form: dict[int, ScoreForm] = {}
        # linear calibrators also as (weights [F], bias with the threshold moved into it)
        self._score: dict[int, tuple[np.ndarray, float]] = {}
        self._raw_linear: dict[int, tuple[np.ndarray, float]] = {}  # the calibrator's own, no threshold
        for k in table.exit_layers[:-1]:
            cal = table.calibrators[k]
            raw = cal.score_form()
            self._form[k] = ScoreForm(raw.w1, raw.b1, raw.w2, _fold(raw.b2, table.score_thresholds[k]))
            if cal.kind is not CalibratorKind.MLP or cal.constant is not None:
                w, b = cal.linear_score()
                self._raw_linear[k] = (np.asarray(w, np.float64), float(b))
                self._score[k] = (np.asarray(w, np.float64), _fold(b, table.score_thresholds[k]))

    def _expect(self, gated: bool) -> None:
        if gated != self.gated:
            raise ConfigError("this threshold table was calibrated on "
                              + ("exit gates, but the model it runs has none" if self.gated else
                                 "softmax signals, but the model it runs decides from exit gates")
                              + "; re-run `smartexit calibrate` for this checkpoint")

    def decide(self, layer: int, stats: dict[int, np.ndarray], tokens: dict[int, np.ndarray],
               hidden: dict[int, np.ndarray]) -> np.ndarray:
        """Softmax statistics [B, 3], argmax [B] and normalised hidden [B, D] of every exit reached so
        far (``layer`` the deepest) -> exit here, bool [B] (:mod:`edge.runtime.rules`)."""
        self._expect(False)
        w, b = self._score[layer]
        return signals_from_stats(stats, tokens, hidden, num_exits=self._m) @ w + b >= 0.0

    def decide_gated(self, layer: int, gates: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> np.ndarray:
        """For a model with exit gates: gate logits [B] of every exit reached so far, hidden [B, D]; bool [B]."""
        self._expect(True)
        w, b = self._score[layer]
        return gated_signals(gates, hidden) @ w + b >= 0.0

    def agreement(self, layer: int, features: np.ndarray) -> np.ndarray:
        """Calibrated probability [B] that decision exit ``layer``'s token is the full model's, from the
        exit's features [B, F] as the segment graphs compute them (the table's signal order): for greedy
        self-speculative decoding, the probability that a draft from this exit is accepted."""
        f = np.asarray(features, np.float64)
        cal, raw = self.table.calibrators[layer], self._raw_linear.get(layer)
        # a linear score without the calibrator's input checks (a draft step's hot path); an mlp one its own way
        return cal.probability(f @ raw[0] + raw[1] if raw is not None else cal.score(f))

    def _interface(self, num_features: int) -> None:
        if num_features != len(self.table.signal_names):
            self._expect(not self.gated)  # the message says which interface the table was calibrated on
            names = self.table.signal_names
            raise ConfigError(f"this threshold table was calibrated on {len(names)} signals "
                              f"({_shown(names)}); the model's exits give {num_features}: "
                              f"re-run `smartexit calibrate` for this checkpoint")

    def linear(self, layer: int, num_features: int) -> tuple[np.ndarray, float]:
        """The rule at decision exit ``layer`` as a linear score of the exit's features (in the order of
        the table's signal names): exit where features @ w + b >= 0 (the engine computes it in the
        segment graphs). Raises ConfigError when the model's features are not the table's signals, or
        the calibrator's score is not linear (mlp: :meth:`score_form`)."""
        self._interface(num_features)
        if layer not in self._score:
            raise ConfigError(f"exit {layer}'s calibrator ({self.table.calibrator_kind}) is not a linear score")
        return self._score[layer]

    def score_form(self, layer: int, num_features: int) -> ScoreForm:
        """The rule at decision exit ``layer`` as a :class:`ScoreForm` of the check's features (what a
        candidate-shortlist model's graphs compute): exit where it is >= 0."""
        self._interface(num_features)
        return self._form[layer]
