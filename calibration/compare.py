"""The exit rules the report compares, all certified (or not) on the same certify units.

(a) a max-probability threshold tuned on the certify units without a
certificate (common practice), (b) max-probability + Learn-then-Test (CALM-like,
no consistency signals), (c) Platt and (d) isotonic calibration of all signals +
Learn-then-Test; each evaluated teacher-forced on the held-out text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from calibration import certify as cert
from calibration.calibrators import CalibratorKind, brier_score, expected_calibration_error
from calibration.collect import Collected
from calibration.evaluate import EvalResult, evaluate_cascade
from calibration.pvalues import PValue
from calibration.risk import NEVER_EXIT
from calibration.signals import exit_targets
from edge.runtime.rules import TOP1


@dataclass
class System:
    """One exit rule compared in the report."""

    name: str
    certified: bool
    lam: float
    bound: float | None
    calib_rate: float
    test: EvalResult
    calibration_quality: dict[str, dict[str, float]] | None = None

    def row(self) -> dict[str, Any]:
        return {"system": self.name, "certified": self.certified, "lambda": self.lam,
                "false_exit_rate_calib": self.calib_rate, "bound": self.bound,
                "false_exit_rate_test": self.test.false_exit_rate, "layers_skipped_frac": self.test.layers_skipped_frac,
                "accuracy_loss_rel": self.test.accuracy_loss_rel, "exit_fraction": self.test.exit_fraction}



def baselines(fit: Collected, certify: Collected, test: Collected, lams: np.ndarray, eps: float, delta: float,
              method: PValue, order_seed: int | None, gated: bool = False) -> list[System]:
    """(a) hand-tuned max-probability, (b) max-probability + LTT, (c) Platt + LTT, (d) isotonic + LTT,
    all walked over the whole grid on the certify units' teacher-forced signals (the continuations were
    generated with the shipped kind's provisional rule: for the other kinds these are comparisons,
    not certificates of their own regime). For a model with exit gates, column 0 of the signals is the
    gate's probability, so (a) and (b) threshold the gate (CALM's learned classifier) instead."""
    systems = []
    top1 = {k: certify.signals[k][:, TOP1] for k in certify.exit_layers[:-1]}
    losses = cert.unit_losses(top1, certify, lams)  # [U, G]
    ok = losses.mean(axis=0) <= eps
    idx = int(np.flatnonzero(ok)[-1]) if ok.any() else None  # loosest with empirical rate <= eps
    lam = float(lams[idx]) if idx is not None else NEVER_EXIT
    rate = float(losses[:, idx].mean()) if idx is not None else 0.0
    single = "gate prob" if gated else "max-prob"
    systems.append(System(f"(a) {single}, hand-tuned, no certificate", False, lam, None, rate,
                          evaluate_cascade(test, {k: test.signals[k][:, TOP1] for k in top1}, lam)))
    for kind, label in ((CalibratorKind.MAXPROB, f"(b) {single} + LTT (CALM-like)"),
                        (CalibratorKind.PLATT, "(c) all signals, Platt + LTT"),
                        (CalibratorKind.ISOTONIC, "(d) all signals, isotonic + LTT")):
        cals = cert.fit(fit, kind)
        c = cert.certify(cert.calibrated(cals, certify), certify, lams, eps, delta, method, order_seed)
        tp = cert.calibrated(cals, test)
        tc = exit_targets(test.argmax)
        quality = {str(k): {"ece": expected_calibration_error(tp[k], tc[k]), "brier": brier_score(tp[k], tc[k])}
                   for k in cals}
        systems.append(System(label, c.certified, c.lam, c.bound, c.empirical_risk, evaluate_cascade(test, tp, c.lam),
                              quality))
    return systems
