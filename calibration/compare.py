"""The exit rules the report compares, all certified (or not) on the same certify units.

(a) a max-probability threshold tuned on the certify units without a
certificate (common practice), (b) max-probability + Learn-then-Test (CALM-like,
no consistency signals), (c) Platt and (d) isotonic calibration of all signals +
Learn-then-Test, (e) with a candidate shortlist, an MLP score of all signals (its
sigmoid) + Learn-then-Test; each evaluated teacher-forced on the held-out text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from calibration import certify as cert
from calibration.calibrators import CalibratorKind
from calibration.collect import Collected
from calibration.evaluate import EvalResult, evaluate_cascade
from calibration.metrics import brier_score, expected_calibration_error
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



def _single(data: Collected, candidates: bool, route: float) -> dict[int, np.ndarray]:
    """The single signal (a) thresholds, in [0, 1] for the grid: the softmax (or gate) top-1 probability, or
    for a candidate-shortlist model the sigmoid of its top candidate logit (monotone: the same ranking), -1 on
    rows the shortlist model's routing never checks."""
    out = {}
    for k in data.exit_layers[:-1]:
        x = data.signals[k][:, TOP1]
        out[k] = 1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0))) if candidates else x
    return cert.unrouted_below(out, data.signals, route)


def baselines(fit: Collected, certify: Collected, test: Collected, lams: np.ndarray, epsilon: float, delta: float,
              method: PValue, order_seed: int | None, gated: bool = False, candidates: bool = False,
              route: float = 0.0, fitted: dict[CalibratorKind, dict] | None = None) -> list[System]:
    """(a) hand-tuned max-probability, (b) max-probability + LTT, (c) Platt + LTT, (d) isotonic + LTT,
    all walked over the whole grid on the certify units' teacher-forced signals (the continuations were
    generated with the shipped kind's provisional rule: for the other kinds these are comparisons,
    not certificates of their own regime). For a model with exit gates, column 0 of the signals is the
    gate's probability, so (a) and (b) threshold the gate (CALM's learned classifier) instead.
    ``fitted``: calibrators already fitted on ``fit`` by kind (the shipped rule's), used instead of a refit."""
    systems = []
    top1 = _single(certify, candidates, route)
    losses = cert.unit_losses(top1, certify, lams)  # [U, G]
    ok = losses.mean(axis=0) <= epsilon
    idx = int(np.flatnonzero(ok)[-1]) if ok.any() else None  # loosest with empirical rate <= epsilon
    lam = float(lams[idx]) if idx is not None else NEVER_EXIT
    rate = float(losses[:, idx].mean()) if idx is not None else 0.0
    single = "gate prob" if gated else ("top candidate logit" if candidates else "max-prob")
    systems.append(System(f"(a) {single}, hand-tuned, no certificate", False, lam, None, rate,
                          evaluate_cascade(test, _single(test, candidates, route), lam)))
    kinds = [(CalibratorKind.MAXPROB, f"(b) {single} + LTT (CALM-like)"),
             (CalibratorKind.PLATT, "(c) all signals, Platt + LTT"),
             (CalibratorKind.ISOTONIC, "(d) all signals, isotonic + LTT")]
    if candidates:  # the score the candidate graphs can compute beyond a linear one
        kinds.append((CalibratorKind.MLP, "(e) all signals, MLP (its sigmoid) + LTT"))
    fitted = dict(fitted or {})
    for kind, label in kinds:
        cals = fitted.get(kind)
        if cals is None and kind is CalibratorKind.ISOTONIC and CalibratorKind.PLATT in fitted:
            cals = cert.isotonic_over(fitted[CalibratorKind.PLATT], fit, route)  # one logistic fit for (c) and (d)
        cals = fitted[kind] = cals or cert.fit(fit, kind, route)
        c = cert.certify(cert.calibrated(cals, certify, route), certify, lams, epsilon, delta, method, order_seed)
        tp = cert.calibrated(cals, test)  # the calibrators' quality on every token (routing aside)
        tc = exit_targets(test.argmax)
        quality = {str(k): {"ece": expected_calibration_error(tp[k], tc[k]), "brier": brier_score(tp[k], tc[k])}
                   for k in cals}
        systems.append(System(label, c.certified, c.lam, c.bound, c.empirical_risk,
                              evaluate_cascade(test, cert.calibrated(cals, test, route), c.lam), quality))
    return systems
