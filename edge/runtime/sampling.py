"""Token choice from logits: greedy, or temperature + nucleus (top-p) sampling (Holtzman et al. 2020)."""
from __future__ import annotations

import numpy as np


def choose_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator | None) -> int:
    """logits [V] -> token id. ``temperature == 0`` is greedy (argmax, lowest id on ties)."""
    if temperature <= 0.0 or rng is None:
        return int(np.argmax(logits))
    p = token_distribution(logits, temperature, top_p)
    return int(rng.choice(p.shape[0], p=p))


def token_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution :func:`choose_token` samples from, float64 [V] (one-hot at the argmax when
    ``temperature == 0``): what speculative sampling compares draft and full model with."""
    if temperature <= 0.0:
        p = np.zeros(logits.shape[0])
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        q = np.zeros_like(p)
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]  # smallest prefix with mass >= top_p
        q[keep] = p[keep]
        p = q / q.sum()
    return p
