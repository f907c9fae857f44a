"""The mlp kind's learned score: a one-hidden-layer ReLU network on the standardised signals (SpecEE's
per-layer predictor, Xu et al., ISCA 2025, smaller), its size and weight decay, its fit, its score, and the
same score on the raw signals as the graphs compute it (:class:`calibration.calibrators.Calibrator`)."""
from __future__ import annotations

import numpy as np

from edge.runtime.rules import ScoreForm

MLP_HIDDEN = 16  # hidden units of the mlp kind (edge.runtime.backend.MAX_HIDDEN bounds what a graph takes)
# L2 weight decay of the mlp kind. A few named signals fit with almost none; a candidate check's features carry
# the exit hidden state (9 + D columns, edge.model.candidates), which on ~25k fit tokens overfits without it:
# layers skipped at 0.6% held-out false exits, shipped model, exits 1/2/4: 0.209 / 0.214 / 0.192 / 0.142 with
# alpha 0.3 / 1 / 3 / 10 (docs/runtime.md)
MLP_ALPHA, MLP_ALPHA_WIDE, MLP_WIDE = 1e-4, 1.0, 32


def fit_mlp(z: np.ndarray, y: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(w1 [F, H], b1 [H], w2 [H], b2) of the network fitted with the log-loss on standardised signals
    z [N, F] and 0/1 targets y [N]; the wide weight decay above :data:`MLP_WIDE` columns."""
    from sklearn.neural_network import MLPClassifier

    alpha = MLP_ALPHA_WIDE if z.shape[1] > MLP_WIDE else MLP_ALPHA
    net = MLPClassifier((MLP_HIDDEN,), activation="relu", alpha=alpha, max_iter=300, early_stopping=True,
                        random_state=seed)
    net.fit(z, y)
    return (net.coefs_[0].astype(np.float64), net.intercepts_[0].astype(np.float64),
            net.coefs_[1][:, 0].astype(np.float64), float(net.intercepts_[1][0]))


def mlp_score(z: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: float) -> np.ndarray:
    """The network's logit [N] of standardised signals z [N, F]."""
    return np.maximum(z @ w1 + b1, 0.0) @ w2 + b2  # [N]


def mlp_score_form(mean: np.ndarray, std: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
                   b2: float) -> ScoreForm:
    """:func:`mlp_score` on the raw signals, standardisation (mean [F], std [F]) folded into the first layer."""
    w1_raw = w1 / std[:, None]  # [F, H]
    return ScoreForm(w1_raw.astype(np.float32), (b1 - (mean / std) @ w1).astype(np.float32),
                     w2.astype(np.float32), float(b2))
