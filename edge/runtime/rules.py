"""Batched exit rules for the engine.

``decide(layer, stats, tokens, hidden)`` gets, for the rows still running and
for every exit reached so far (``layer`` is the current one): the softmax
statistics [B, 3] (top-1 probability, top-1 minus top-2, entropy) and the
argmax [B] that the segment graph computed, and the normalised hidden state
[B, D]; it returns a bool [B]: exit here. The logits themselves never reach the
rule, so no softmax over the vocabulary runs on the host.

With exit gates (``exits.gate_hidden`` > 0) the engine calls ``decide_gated(layer,
gates, hidden)`` instead: the gates' logits [B] per exit reached, and the LM head
runs only for the rows the rule lets exit.

The engine's rules are also the reference generator's (:mod:`edge.model.reference`
asks ``decide`` / ``decide_gated`` with one row), so each rule is written once, in
numpy.

A rule that is a linear score of the exit's features (the columns of
``calibration.signals.SIGNAL_NAMES``, or ``GATED_SIGNAL_NAMES`` with gates) says so
with ``linear(layer, num_features) -> (w [F], b)``: exit where features @ w + b >= 0.
The engine then has the segment graphs compute the score and only reads its sign,
and never calls ``decide``.

A model with a candidate shortlist (:mod:`edge.model.candidates`) decides from a small MLP of
the check's features, :class:`ScoreForm`; a linear rule is one (two hidden units, exactly), and a
rule that has a non-linear score says so with ``score_form(layer, num_features) -> ScoreForm``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

ExitTrace = dict[int, np.ndarray]  # exit layer -> per-row array

# Column of the softmax top-1 probability in the exit statistics [B, 3] and in the exit features
# (``calibration.signals.SIGNAL_NAMES``), and of the gate probability in the features of a model with
# exit gates (``GATED_SIGNAL_NAMES``): what a single-signal rule thresholds.
TOP1 = 0


class BatchExitRule(Protocol):
    def decide(self, layer: int, stats: ExitTrace, tokens: ExitTrace, hidden: ExitTrace) -> np.ndarray: ...

    # optional: the rule as a linear score of the exit features, computed in the segment graphs
    def linear(self, layer: int, num_features: int) -> tuple[np.ndarray, float]: ...

    # models with exit gates (edge.model.exits.ExitGate): the gate logits [B] of every exit reached so far
    def decide_gated(self, layer: int, gates: ExitTrace, hidden: ExitTrace) -> np.ndarray: ...


@dataclass(frozen=True)
class ScoreForm:
    """An exit score: ``w2 . relu(features @ w1 + b1) + b2``, exit where it is >= 0 (float32; the form
    the candidate-set graphs compute, with the rule's weights as graph inputs)."""

    w1: np.ndarray  # [F, H]
    b1: np.ndarray  # [H]
    w2: np.ndarray  # [H]
    b2: float

    @classmethod
    def linear(cls, w: np.ndarray, b: float) -> "ScoreForm":
        """features @ w + b as an MLP of two hidden units: relu(a) - relu(-a) = a, exactly."""
        w = np.asarray(w, np.float32)
        return cls(np.stack([w, -w], axis=1), np.array([b, -b], np.float32), np.array([1.0, -1.0], np.float32), 0.0)

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """The score [B] of features [B, F], in float32."""
        h = np.maximum(np.asarray(features, np.float32) @ self.w1.astype(np.float32) + self.b1.astype(np.float32), 0)
        return (h @ self.w2.astype(np.float32) + np.float32(self.b2)).astype(np.float32)


def score_form(rule, layer: int, num_features: int) -> ScoreForm:
    """The rule's score at decision exit ``layer`` as a :class:`ScoreForm`: its own ``score_form`` if it has
    one, else its linear score."""
    own = getattr(rule, "score_form", None)
    if own is not None:
        return own(layer, num_features)
    return ScoreForm.linear(*rule.linear(layer, num_features))


class NeverExit:
    """Full depth for every token (the engine's baseline)."""

    def linear(self, layer, num_features):
        return np.zeros(num_features), -1.0  # score -1 < 0: never

    def decide(self, layer, stats, tokens, hidden):
        return np.zeros(tokens[layer].shape[0], dtype=bool)

    def decide_gated(self, layer, gates, hidden):
        return np.zeros(gates[layer].shape[0], dtype=bool)


class ConfidenceRule:
    """Exit when the softmax top-1 probability (or, with gates, sigmoid of the gate logit) reaches
    ``threshold`` (uncalibrated)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        # sigmoid(g) >= threshold  <=>  g >= logit(threshold)
        self._logit = (float(np.log(threshold / (1 - threshold))) if 0 < threshold < 1
                       else (-np.inf if threshold <= 0 else np.inf))

    def decide(self, layer, stats, tokens, hidden):
        return stats[layer][:, TOP1] >= self.threshold

    def linear(self, layer, num_features):
        """top-1 probability (or, with gates, the gate probability: feature TOP1 either way) >= threshold."""
        w = np.zeros(num_features)
        w[TOP1] = 1.0
        return w, -self.threshold

    def decide_gated(self, layer, gates, hidden):
        return gates[layer] >= self._logit
