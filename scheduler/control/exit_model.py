"""Exit depths as the simulator draws them: the calibrated marginal over exit layers and, per request, a
distribution ~ Dirichlet around it (``ExitModel``), fitted from measured per-request exit traces where they exist.

Requests differ in how easy their text is (some exit early often, some rarely), which is what makes a
per-request predicted exit depth worth having; the simulator (scheduler/control/sim.py) draws each request's
exit layers from its own distribution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edge.core.errors import ConfigError


@dataclass
class ExitModel:
    """Exit layers (ascending, the last = full depth) and their marginal token fractions; per request,
    a distribution ~ Dirichlet(concentration x marginal)."""

    layers: list[int]
    fractions: list[float]
    concentration: float = 4.0

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.fractions) or not self.layers:
            raise ConfigError(f"exit model: {len(self.layers)} layers but {len(self.fractions)} fractions")
        if list(self.layers) != sorted(self.layers):
            raise ConfigError(f"exit model: layers must ascend, got {self.layers}")
        f = np.asarray(self.fractions, np.float64)
        if (f < 0).any() or f.sum() <= 0 or self.concentration <= 0:
            raise ConfigError("exit model: fractions must be >= 0 with a positive sum, concentration > 0")
        self.fractions = list(f / f.sum())

    @property
    def mean_layer(self) -> float:
        return float(np.dot(self.layers, self.fractions))

    def request_probs(self, rng: np.random.Generator) -> np.ndarray:
        """[len(layers)] one request's exit distribution."""
        alpha = np.maximum(np.asarray(self.fractions) * self.concentration, 1e-3)
        return rng.dirichlet(alpha)

    @classmethod
    def from_certificate(cls, exit_layers: Sequence[int], fractions: dict[str, float] | None,
                         concentration: float = 4.0) -> ExitModel:
        """From a threshold table's ``expected_exit_fraction`` ({layer: share}); full depth without one."""
        if not fractions:
            return cls(list(exit_layers), [0.0] * (len(exit_layers) - 1) + [1.0], concentration)
        return cls(list(exit_layers), [float(fractions.get(str(k), 0.0)) for k in exit_layers], concentration)

    @classmethod
    def fit(cls, exit_layers: Sequence[int], traces: Sequence[Sequence[int]], min_tokens: int = 8) -> ExitModel:
        """Marginal and concentration from per-request exit-layer sequences (method of moments on
        the requests' share of full-depth tokens: for a Dirichlet-multinomial, the variance of a
        request's share p is m (1 - m) / (c + 1) plus the binomial noise m (1 - m) / n).

        Raises:
            ConfigError: fewer than 4 requests with ``min_tokens`` tokens.
        """
        layers = list(exit_layers)
        seqs = [list(t) for t in traces if len(t) >= min_tokens]
        if len(seqs) < 4:
            raise ConfigError(f"exit model: {len(seqs)} requests with >= {min_tokens} tokens; at least 4 needed")
        counts = np.array([[s.count(k) for k in layers] for s in seqs], np.float64)  # [R, E]
        marginal = counts.sum(0) / counts.sum()
        full = counts[:, -1] / counts.sum(1)
        m = float(marginal[-1])
        noise = float(np.mean(m * (1 - m) / counts.sum(1)))
        between = max(float(np.var(full)) - noise, 1e-6)
        c = m * (1 - m) / between - 1 if 0 < m < 1 else 4.0
        return cls(layers, list(marginal), float(np.clip(c, 0.5, 1e3)))
