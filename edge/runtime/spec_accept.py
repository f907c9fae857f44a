"""Mode exact's acceptance rules, pure functions on the per-token path: greedy (:func:`accept_greedy`: the
drafts up to the first that is not the full model's token) and speculative sampling (:func:`accept_sampled`:
Leviathan et al. 2023; Chen et al. 2023); the algorithm is in edge/runtime/speculative.py."""
from __future__ import annotations

import numpy as np


def accept_greedy(drafts: list[int], full: np.ndarray) -> tuple[int, int]:
    """(accepted drafts n, the token after them): ``full`` [k + 1] are the full model's greedy tokens at
    the positions of drafts x_1..x_k and the one after."""
    n = 0
    while n < len(drafts) and drafts[n] == full[n]:
        n += 1
    return n, int(full[n])


def accept_sampled(drafts: list[int], q: list[np.ndarray], p: list[np.ndarray], rng: np.random.Generator
                   ) -> tuple[int, int]:
    """Speculative sampling: (accepted drafts n, the token after them). ``q[j]`` is the distribution draft
    x_{j+1} was drawn from, ``p[j]`` the full model's at its position; ``p`` has one more entry, for the
    position after the last draft."""
    for n, x in enumerate(drafts):
        if rng.random() * q[n][x] >= p[n][x]:  # reject: u >= p(x) / q(x)
            residual = np.maximum(p[n] - q[n], 0.0)
            total = residual.sum()
            # p == q up to rounding leaves no residual mass (rejection had probability ~0): draw from p
            dist = residual / total if total > 0 else p[n]
            return n, int(rng.choice(dist.shape[0], p=dist))
    return len(drafts), int(rng.choice(p[-1].shape[0], p=p[-1]))
