"""Batched exit rules for the engine.

``decide(layer, logits, hidden)`` gets, for the rows still running, the logits
[B, V] and normalised hidden states [B, D] of every exit reached so far
(``logits[layer]`` is the current one) and returns a bool [B]: exit here.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class BatchExitRule(Protocol):
    def decide(self, layer: int, logits: dict[int, np.ndarray], hidden: dict[int, np.ndarray]) -> np.ndarray: ...


class NeverExit:
    """Full depth for every token (the engine's baseline)."""

    def decide(self, layer, logits, hidden):
        return np.zeros(logits[layer].shape[0], dtype=bool)


class ConfidenceRule:
    """Exit when the softmax top-1 probability reaches ``threshold`` (uncalibrated)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def decide(self, layer, logits, hidden):
        z = logits[layer].astype(np.float64)
        z = z - z.max(axis=1, keepdims=True)
        top1 = 1.0 / np.exp(z).sum(axis=1)  # max prob = exp(0) / sum
        return top1 >= self.threshold
