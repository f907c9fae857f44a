"""Evaluating an exit rule teacher-forced on held-out text (free-running: :mod:`calibration.freerun`).

Definitions (issue 3): a *false exit* is a token whose early-exit prediction
differs from the full model's greedy prediction on the same prefix; *accuracy*
is top-1 next-token accuracy against the real text; *accuracy loss* is
(acc_full - acc_exit) / acc_full. On unit-tagged data with the same number of
tokens per unit, the token rate equals the mean per-unit rate.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibration.cascade import cascade
from calibration.collect import Collected


@dataclass
class EvalResult:
    false_exit_rate: float
    accuracy_full: float
    accuracy_exit: float
    accuracy_loss_rel: float
    layers_skipped_frac: float
    exit_fraction: dict[str, float]  # exit layer -> fraction of tokens


def evaluate_cascade(data: Collected, probs: dict[int, np.ndarray], lam: float) -> EvalResult:
    """Teacher-forced: each token exits at the first exit with prob >= lam (probs: decision exits -> [N])."""
    exit_at = cascade(probs, lam, data.final)  # [N]
    emitted = np.empty(data.n, dtype=np.int64)
    for k in data.exit_layers:
        sel = exit_at == k
        emitted[sel] = data.argmax[k][sel]
    full = data.argmax[data.final]
    acc_full = float((full == data.next_token).mean())
    acc_exit = float((emitted == data.next_token).mean())
    return EvalResult(
        false_exit_rate=float((emitted != full).mean()),
        accuracy_full=acc_full,
        accuracy_exit=acc_exit,
        accuracy_loss_rel=(acc_full - acc_exit) / acc_full if acc_full > 0 else 0.0,
        layers_skipped_frac=float(((data.final - exit_at) / data.final).mean()),
        exit_fraction={str(k): float((exit_at == k).mean()) for k in data.exit_layers},
    )
