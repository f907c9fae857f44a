"""Exit signals against hand-computed values and their mathematical ranges.

The signals are computed one way, from what the segment graphs output (softmax statistics and
argmax by :func:`edge.model.exits.exit_decision_stats`, in float32); the tests feed that function
hand-made logits.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from calibration.signals import (GATED_SIGNAL_NAMES, SIGNAL_NAMES, exit_targets, gated_signals,
                                 gated_signals_all_exits, signals_all_exits, signals_from_stats)
from edge.core.errors import ConfigError
from edge.model.exits import exit_decision_stats
from edge.runtime.rules import TOP1

COL = {name: i for i, name in enumerate(SIGNAL_NAMES)}
RTOL32 = 1e-6  # the statistics are float32: a few ulps (eps32 = 1.2e-7) of values of order 1

# 3 exits (layers 2, 4, 6), 4 tokens, V = 5. Argmaxes per token:
#   token 0: 0, 0, 0  (all agree)     token 1: 1, 2, 2  (agree at the last only)
#   token 2: 3, 3, 4  (agree then no) token 3: 4, 0, 4  (never consecutive)
ARGS = {2: [0, 1, 3, 4], 4: [0, 2, 3, 0], 6: [0, 2, 4, 4]}


def _logits() -> dict[int, np.ndarray]:
    out = {}
    for k, args in ARGS.items():
        z = np.zeros((4, 5))
        z[np.arange(4), args] = math.log(4.0)  # softmax: 4/8 on the argmax, 1/8 elsewhere
        out[k] = z
    return out


def _hidden() -> dict[int, np.ndarray]:
    return {2: np.array([[1.0, 0.0]] * 4), 4: np.array([[1.0, 1.0]] * 4), 6: np.array([[0.0, -2.0]] * 4)}


def _graph(logits: dict[int, np.ndarray]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """What the segment graphs output per exit: (stats [N, 3], argmax [N])."""
    stats, tokens = {}, {}
    for k, z in logits.items():
        s, t = exit_decision_stats(torch.from_numpy(np.asarray(z, np.float32)))
        stats[k], tokens[k] = s.numpy(), t.numpy()
    return stats, tokens


def _signals(logits=None, hidden=None) -> dict[int, np.ndarray]:
    stats, tokens = _graph(_logits() if logits is None else logits)
    return signals_all_exits(stats, tokens, _hidden() if hidden is None else hidden)


def test_softmax_columns_hand_computed():
    sig = _signals()
    assert sorted(sig) == [2, 4, 6]
    for x in sig.values():
        assert x.shape == (4, len(SIGNAL_NAMES)) and x.dtype == np.float64
        np.testing.assert_allclose(x[:, COL["top1_prob"]], 0.5, rtol=RTOL32)
        np.testing.assert_allclose(x[:, COL["margin"]], 0.5 - 0.125, rtol=RTOL32)
        entropy = -(0.5 * math.log(0.5) + 4 * 0.125 * math.log(0.125))
        np.testing.assert_allclose(x[:, COL["entropy"]], entropy, rtol=RTOL32)


def test_agreement_columns_hand_computed():
    sig = _signals()
    np.testing.assert_array_equal(sig[2][:, COL["agree_prev"]], [0, 0, 0, 0])
    np.testing.assert_array_equal(sig[4][:, COL["agree_prev"]], [1, 0, 1, 0])
    np.testing.assert_array_equal(sig[6][:, COL["agree_prev"]], [1, 1, 0, 0])
    np.testing.assert_allclose(sig[2][:, COL["agree_run"]], [0, 0, 0, 0])
    np.testing.assert_allclose(sig[4][:, COL["agree_run"]], np.array([1, 0, 1, 0]) / 3)
    np.testing.assert_allclose(sig[6][:, COL["agree_run"]], np.array([2, 1, 0, 0]) / 3)


def test_cosine_column_hand_computed():
    sig = _signals()
    np.testing.assert_allclose(sig[2][:, COL["cos_prev"]], 0.0)
    np.testing.assert_allclose(sig[4][:, COL["cos_prev"]], 1 / math.sqrt(2))
    np.testing.assert_allclose(sig[6][:, COL["cos_prev"]], -1 / math.sqrt(2))


def test_cosine_of_zero_vector_is_zero():
    hidden = _hidden()
    hidden[4] = np.zeros((4, 2))
    np.testing.assert_array_equal(_signals(hidden=hidden)[4][:, COL["cos_prev"]], 0.0)


def test_softmax_is_stable_for_huge_logits():
    z = {1: np.array([[1e6, 1e6 - 1.0, -1e6]]), 2: np.array([[0.0, 0.0, 0.0]])}
    h = {1: np.ones((1, 3)), 2: np.ones((1, 3))}
    sig = _signals(z, h)
    p1 = 1 / (1 + math.exp(-1.0))
    np.testing.assert_allclose(sig[1][0, :3], [p1, p1 - (1 - p1), -(p1 * math.log(p1) + (1 - p1) * math.log(1 - p1))],
                               rtol=RTOL32)
    np.testing.assert_allclose(sig[2][0, :3], [1 / 3, 0.0, math.log(3)], rtol=RTOL32, atol=1e-7)


def test_graph_statistics_against_a_float64_softmax():
    """The statistics every signal starts from, against softmax computed in float64, ties included."""
    rng = np.random.default_rng(11)
    z = (rng.normal(size=(64, 300)) * rng.uniform(0.1, 20, size=(64, 1))).astype(np.float32)
    z[0, :2] = 50.0  # a tie for the top: margin 0, argmax the lower id
    z[1, 7] += 60.0  # a near-certain exit: top-1 probability ~1, entropy ~0
    s, t = exit_decision_stats(torch.from_numpy(z))
    x = z.astype(np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top2 = np.sort(p, axis=1)[:, -2:]
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
    np.testing.assert_allclose(s.numpy(), np.stack([top2[:, 1], top2[:, 1] - top2[:, 0], entropy], axis=1),
                               rtol=1e-5, atol=1e-6)
    assert np.array_equal(t.numpy(), np.argmax(z, axis=1))
    assert s[0, 1] == 0.0 and t[0] == 0


def test_targets_of_the_decision_exits():
    y = exit_targets({k: np.asarray(v) for k, v in ARGS.items()})
    assert sorted(y) == [2, 4]  # the last exit is never a decision point
    np.testing.assert_array_equal(y[2], [1, 0, 0, 1])
    np.testing.assert_array_equal(y[4], [1, 1, 0, 0])
    assert y[2].dtype == np.int64
    with pytest.raises(ConfigError, match="exit 2: argmax shape"):
        exit_targets({2: np.zeros(3, int), 6: np.zeros(4, int)})
    with pytest.raises(ConfigError, match="no exits"):
        exit_targets({})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 12), st.integers(1, 3), st.data())
def test_signal_ranges(n, v, m, data):
    finite = st.floats(-60, 60, allow_nan=False, allow_infinity=False)
    logits = {k: data.draw(arrays(np.float64, (n, v), elements=finite)) for k in range(1, m + 1)}
    hidden = {k: data.draw(arrays(np.float64, (n, 3), elements=finite)) for k in range(1, m + 1)}
    for x in _signals(logits, hidden).values():
        top1, margin, entropy = x[:, COL["top1_prob"]], x[:, COL["margin"]], x[:, COL["entropy"]]
        assert ((top1 > 0) & (top1 <= 1)).all()
        assert ((margin >= 0) & (margin <= top1)).all()
        assert ((entropy >= 0) & (entropy <= math.log(v) * (1 + RTOL32))).all()
        assert ((x[:, COL["agree_run"]] >= 0) & (x[:, COL["agree_run"]] < 1)).all()
        assert (np.abs(x[:, COL["cos_prev"]]) <= 1).all()


def test_every_exit_is_computed_as_at_run_time():
    """Calibration's signals at exit k are the runtime's signals with the exits up to k (the rule
    sees no deeper exit), from whatever deeper exits the token reaches later."""
    rng = np.random.default_rng(7)
    layers = [3, 6, 9, 12]
    logits = {k: rng.normal(size=(50, 5)) * 3 for k in layers}  # few distinct argmaxes: agreement runs occur
    hidden = {k: rng.normal(size=(50, 8)) for k in layers}
    stats, tokens = _graph(logits)
    every = signals_all_exits(stats, tokens, hidden)
    for upto in range(1, 5):
        sub = layers[:upto]
        got = signals_from_stats({k: stats[k] for k in sub}, {k: tokens[k] for k in sub},
                                 {k: hidden[k] for k in sub}, num_exits=4)
        assert np.array_equal(got, every[sub[-1]])


def test_single_signal_column_is_top1_or_gate_probability():
    assert SIGNAL_NAMES[TOP1] == "top1_prob" and GATED_SIGNAL_NAMES[TOP1] == "gate_prob"


def test_gated_signals_hand_computed_and_consistent():
    gates = {3: np.array([0.0, 2.0]), 9: np.array([np.log(3.0), -50.0])}
    hidden = {3: np.array([[1.0, 0.0], [1.0, 1.0]]), 9: np.array([[0.0, 2.0], [2.0, 2.0]])}
    s = gated_signals(gates, hidden)  # deepest exit: 9
    assert s.shape == (2, len(GATED_SIGNAL_NAMES))
    np.testing.assert_allclose(s[:, 0], [0.75, 1 / (1 + np.exp(50.0))], rtol=1e-12)  # sigmoid(log 3) = 3/4
    np.testing.assert_allclose(s[:, 1], 1 / (1 + np.exp(-np.array([0.0, 2.0]))), rtol=1e-12)
    np.testing.assert_allclose(s[:, 2], [0.0, 1.0], atol=1e-12)  # orthogonal; parallel
    first = gated_signals({3: gates[3]}, hidden)
    np.testing.assert_array_equal(first[:, 1:], 0.0)
    every = gated_signals_all_exits(gates, hidden)
    np.testing.assert_array_equal(every[9], s)
    np.testing.assert_array_equal(every[3], first)
