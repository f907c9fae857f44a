"""Cascade evaluation on hand-made data: which exit each token takes, what it emits, what that costs."""
from __future__ import annotations

import numpy as np
import pytest

from calibration.cascade import false_exit_counts, unit_false_exit_counts
from calibration.certify import unit_losses
from calibration.collect import Collected
from calibration.evaluate import evaluate_cascade
from calibration.risk import NEVER_EXIT
from calibration.signals import exit_targets

# Decision exits 1 and 2, the full model at layer 3; 4 tokens in 2 units (prompts) of 2.
#   token           0     1     2     3
#   argmax exit 1   5     6     7     8
#   argmax exit 2   5     9     7     0
#   full model      5     9     1     0
#   next token      5     9     7     3
#   p exit 1      0.9   0.2  0.95   0.1
#   p exit 2      0.1   0.8   0.3   0.4
ARGMAX = {1: np.array([5, 6, 7, 8]), 2: np.array([5, 9, 7, 0]), 3: np.array([5, 9, 1, 0])}
PROBS = {1: np.array([0.9, 0.2, 0.95, 0.1]), 2: np.array([0.1, 0.8, 0.3, 0.4])}


def _data() -> Collected:
    signals = {k: np.zeros((4, 6)) for k in ARGMAX}
    return Collected([1, 2, 3], signals, ARGMAX, np.array([5, 9, 7, 3]), np.array([0, 0, 1, 1]), 2)


def test_targets_are_agreement_with_the_full_model():
    y = exit_targets(ARGMAX)
    assert y[1].tolist() == [1, 0, 0, 0] and y[2].tolist() == [1, 1, 0, 1] and 3 not in y


def test_evaluate_cascade_hand_computed():
    # lam 0.5: token 0 exits at 1 (emits 5), token 1 at 2 (9), token 2 at 1 (7, the full model says 1),
    # token 3 runs to the end (0)
    r = evaluate_cascade(_data(), PROBS, 0.5)
    assert r.false_exit_rate == 0.25  # token 2
    assert r.accuracy_full == 0.5  # tokens 0, 1 right against the text
    assert r.accuracy_exit == 0.75  # tokens 0, 1, 2: the false exit happens to match the text
    assert r.accuracy_loss_rel == pytest.approx((0.5 - 0.75) / 0.5)
    assert r.layers_skipped_frac == pytest.approx((2 / 3 + 1 / 3 + 2 / 3 + 0) / 4)
    assert r.exit_fraction == {"1": 0.5, "2": 0.25, "3": 0.25}


def test_evaluate_cascade_at_the_extremes():
    never = evaluate_cascade(_data(), PROBS, NEVER_EXIT)  # no probability reaches it: the full model everywhere
    assert never.false_exit_rate == 0.0 and never.layers_skipped_frac == 0.0 and never.accuracy_loss_rel == 0.0
    assert never.exit_fraction == {"1": 0.0, "2": 0.0, "3": 1.0}
    always = evaluate_cascade(_data(), PROBS, 0.0)  # every token exits at exit 1
    assert always.false_exit_rate == 0.75 and always.accuracy_exit == 0.5
    assert always.layers_skipped_frac == pytest.approx(2 / 3)


def test_false_exit_counts_per_threshold_and_per_unit_hand_computed():
    y = exit_targets(ARGMAX)
    lams = np.array([1.0, 0.9, 0.5, 0.25, 0.0])
    # 1.0: nobody exits. 0.9: tokens 0, 2 exit at 1 (token 2 wrong). 0.5: + token 1 at 2 (right).
    # 0.25: + token 3 at 2 (right). 0.0: every token at 1: tokens 1, 2, 3 wrong.
    assert false_exit_counts(PROBS, y, lams, 3).tolist() == [0, 1, 1, 1, 3]
    per_unit = unit_false_exit_counts(PROBS, y, np.array([0, 0, 1, 1]), 2, lams, 3)
    assert per_unit.tolist() == [[0, 0, 0, 0, 1], [0, 1, 1, 1, 2]]
    # the loss a certificate bounds: per-unit false-exit rate (2 judged tokens each)
    assert unit_losses(PROBS, _data(), lams).tolist() == [[0, 0, 0, 0, 0.5], [0, 0.5, 0.5, 0.5, 1.0]]
    # equal tokens per unit: the mean per-unit rate is the token rate evaluate_cascade reports
    assert unit_losses(PROBS, _data(), np.array([0.5])).mean() == evaluate_cascade(_data(), PROBS, 0.5).false_exit_rate
