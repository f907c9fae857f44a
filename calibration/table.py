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
import torch

from calibration.calibrators import Calibrator
from calibration.signals import (GATED_SIGNAL_NAMES, SIGNAL_NAMES, _cosine, _sigmoid, gated_signals, last_exit_signals,
                                 signals_from_stats)
from edge.core.artifacts import atomic_write_json, sha256_path
from edge.core.errors import ArtifactError, ConfigError

TABLE_VERSION = 2


@dataclass
class ThresholdTable:
    checkpoint_sha256: str
    exit_layers: list[int]  # all exits, the last is the full model
    calibrator_kind: str
    lam: float  # threshold on the calibrated probability (shared by all decision exits)
    score_thresholds: dict[int, float]  # decision exit -> raw-score threshold
    calibrators: dict[int, Calibrator]
    certificate: dict[str, Any] = field(default_factory=dict)  # eps, delta, n, empirical rate, bound, ...
    signal_names: tuple[str, ...] = SIGNAL_NAMES
    kv_mode: str = "defer"  # the K/V mode of skipped layers the certificate covers

    def __post_init__(self) -> None:
        if self.kv_mode not in ("defer", "propagate"):
            raise ConfigError(f"threshold table kv_mode must be 'defer' or 'propagate', got {self.kv_mode!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": TABLE_VERSION,
            "checkpoint_sha256": self.checkpoint_sha256,
            "exit_layers": self.exit_layers,
            "signal_names": list(self.signal_names),
            "calibrator_kind": self.calibrator_kind,
            "lambda": self.lam,
            "kv_mode": self.kv_mode,
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
                                                   "calibrator_kind", "lambda", "layers", "kv_mode")]
            return cls(
                checkpoint_sha256=d["checkpoint_sha256"], exit_layers=layers, calibrator_kind=d["calibrator_kind"],
                lam=float(d["lambda"]),
                score_thresholds={k: float(v["score_threshold"]) for k, v in per.items()},
                calibrators={k: Calibrator.from_dict(v["calibrator"]) for k, v in per.items()},
                certificate={k: d[k] for k in cert_keys}, signal_names=tuple(d["signal_names"]),
                kv_mode=d["kv_mode"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed threshold table ({exc!r})") from exc

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())


def _finite_or_str(x: float) -> float | str:
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf")


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


class TableRule:
    """Exit rule that applies a threshold table.

    Recomputes the signals exactly as calibration did and compares the calibrator's raw score with the
    table's threshold (equivalent to calibrated probability >= lambda). A table calibrated on a model
    with exit gates (signals :data:`calibration.signals.GATED_SIGNAL_NAMES`) decides in
    :meth:`decide_gated`, which the engine calls for such models; one calibrated on softmax signals in
    :meth:`decide` (and :meth:`__call__` for :func:`edge.model.reference.generate`).
    """

    def __init__(self, table: ThresholdTable) -> None:
        names = tuple(table.signal_names)
        if names not in (SIGNAL_NAMES, GATED_SIGNAL_NAMES):
            raise ConfigError(f"threshold table signals {list(names)} are not this version's {list(SIGNAL_NAMES)} "
                              f"(or {list(GATED_SIGNAL_NAMES)} for a model with exit gates); re-run "
                              f"`smartexit calibrate`")
        self.table = table
        self.gated = names == GATED_SIGNAL_NAMES
        self._m = len(table.exit_layers)
        self._linear = {k: c.linear_score() for k, c in table.calibrators.items()}  # layer -> (w [F], b)
        # the hot path's constants per decision exit: the previous decision exit (None for the first),
        # the score's weights split by signal, and the threshold moved into the bias
        decision = table.exit_layers[:-1]
        self._fast = {}
        for n, k in enumerate(decision):
            w, b = self._linear[k]
            w = np.asarray(w, np.float64)
            self._fast[k] = (decision[n - 1] if n else None, decision[:n + 1], w, float(b) - table.score_thresholds[k])
        self._logits: dict[int, np.ndarray] = {}
        self._hidden: dict[int, np.ndarray] = {}

    def _expect(self, gated: bool) -> None:
        if gated != self.gated:
            raise ConfigError("this threshold table was calibrated on "
                              + ("exit gates, but the model it runs has none" if self.gated else
                                 "softmax signals, but the model it runs decides from exit gates")
                              + "; re-run `smartexit calibrate` for this checkpoint")

    def reset(self) -> None:
        self._logits.clear()
        self._hidden.clear()

    def __call__(self, layer: int, logits: torch.Tensor, hidden: torch.Tensor) -> bool:
        """logits [V], hidden [D] (normalised) of exit ``layer`` for the current token."""
        self._expect(False)
        self._logits[layer] = logits.detach().double().numpy()[None]
        self._hidden[layer] = hidden.detach().double().numpy()[None]
        feats = last_exit_signals(self._logits, self._hidden, num_exits=len(self.table.exit_layers))  # [1, F]
        return bool(self._passes(layer, feats)[0])

    def decide(self, layer: int, stats: dict[int, np.ndarray], tokens: dict[int, np.ndarray],
               hidden: dict[int, np.ndarray]) -> np.ndarray:
        """Batched form for the engine (:mod:`edge.runtime.rules`): bool [B].

        The calibrator's score is linear in the signals: one dot product per token, no
        standardisation or validation pass (this runs at every exit of every decode step).
        """
        self._expect(False)
        prev, seen, w, b = self._fast[layer]
        score = stats[layer].astype(np.float64) @ w[:3] + b  # top-1 probability, margin, entropy
        if prev is not None:  # agreement with the previous exit, agreement run, hidden cosine
            run = np.zeros(len(score))
            for a, c in zip(seen[:-1], seen[1:]):
                run = np.where(tokens[a] == tokens[c], run + 1.0, 0.0)
            score += w[3] * (tokens[layer] == tokens[prev]) + w[4] / self._m * run
            score += w[5] * _cosine(hidden[layer].astype(np.float64), hidden[prev].astype(np.float64))
        return score >= 0.0

    def linear(self, layer: int, num_features: int) -> tuple[np.ndarray, float]:
        """The rule at decision exit ``layer`` as a linear score of the exit's features (in the order of
        the table's signal names): exit where features @ w + b >= 0 (the engine computes it in the
        segment graphs). Raises ConfigError when the model's features are not the table's signals."""
        if num_features != len(self.table.signal_names):
            self._expect(not self.gated)  # the message says which interface the table was calibrated on
        _, _, w, b = self._fast[layer]
        return w, b

    def decide_gated(self, layer: int, gates: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> np.ndarray:
        """For a model with exit gates: gate logits [B] of every exit reached so far, hidden [B, D]; bool [B]."""
        self._expect(True)
        prev, _, w, b = self._fast[layer]
        score = w[0] * _sigmoid(gates[layer].astype(np.float64)) + b
        if prev is not None:  # the previous exit's gate probability, hidden cosine
            score += w[1] * _sigmoid(gates[prev].astype(np.float64))
            score += w[2] * _cosine(hidden[layer].astype(np.float64), hidden[prev].astype(np.float64))
        return score >= 0.0

    def _passes(self, layer: int, feats: np.ndarray) -> np.ndarray:
        return self.table.calibrators[layer].score(feats) >= self.table.score_thresholds[layer]
