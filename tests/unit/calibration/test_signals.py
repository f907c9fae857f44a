"""Exit signals against hand-computed values and their mathematical ranges."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from calibration.signals import SIGNAL_NAMES, argmaxes, exit_signals, exit_targets
from edge.core.errors import ConfigError

COL = {name: i for i, name in enumerate(SIGNAL_NAMES)}

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


def test_softmax_columns_hand_computed():
    sig = exit_signals(_logits(), _hidden())
    assert sorted(sig) == [2, 4, 6]
    for x in sig.values():
        assert x.shape == (4, len(SIGNAL_NAMES)) and x.dtype == np.float64
        np.testing.assert_allclose(x[:, COL["top1_prob"]], 0.5)
        np.testing.assert_allclose(x[:, COL["margin"]], 0.5 - 0.125)
        entropy = -(0.5 * math.log(0.5) + 4 * 0.125 * math.log(0.125))
        np.testing.assert_allclose(x[:, COL["entropy"]], entropy)


def test_agreement_columns_hand_computed():
    sig = exit_signals(_logits(), _hidden())
    np.testing.assert_array_equal(sig[2][:, COL["agree_prev"]], [0, 0, 0, 0])
    np.testing.assert_array_equal(sig[4][:, COL["agree_prev"]], [1, 0, 1, 0])
    np.testing.assert_array_equal(sig[6][:, COL["agree_prev"]], [1, 1, 0, 0])
    np.testing.assert_allclose(sig[2][:, COL["agree_run"]], [0, 0, 0, 0])
    np.testing.assert_allclose(sig[4][:, COL["agree_run"]], np.array([1, 0, 1, 0]) / 3)
    np.testing.assert_allclose(sig[6][:, COL["agree_run"]], np.array([2, 1, 0, 0]) / 3)


def test_cosine_column_hand_computed():
    sig = exit_signals(_logits(), _hidden())
    np.testing.assert_allclose(sig[2][:, COL["cos_prev"]], 0.0)
    np.testing.assert_allclose(sig[4][:, COL["cos_prev"]], 1 / math.sqrt(2))
    np.testing.assert_allclose(sig[6][:, COL["cos_prev"]], -1 / math.sqrt(2))


def test_cosine_of_zero_vector_is_zero():
    hidden = _hidden()
    hidden[4] = np.zeros((4, 2))
    sig = exit_signals(_logits(), hidden)
    np.testing.assert_array_equal(sig[4][:, COL["cos_prev"]], 0.0)


def test_softmax_is_stable_for_huge_logits():
    z = {1: np.array([[1e6, 1e6 - 1.0, -1e6]]), 2: np.array([[0.0, 0.0, 0.0]])}
    h = {1: np.ones((1, 3)), 2: np.ones((1, 3))}
    sig = exit_signals(z, h)
    p1 = 1 / (1 + math.exp(-1.0))
    np.testing.assert_allclose(sig[1][0, :3], [p1, p1 - (1 - p1), -(p1 * math.log(p1) + (1 - p1) * math.log(1 - p1))])
    np.testing.assert_allclose(sig[2][0, :3], [1 / 3, 0.0, math.log(3)])


def test_argmaxes_and_targets():
    arg = argmaxes(_logits())
    for k, expected in ARGS.items():
        np.testing.assert_array_equal(arg[k], expected)
        assert arg[k].dtype == np.int64
    y = exit_targets(arg)
    np.testing.assert_array_equal(y[2], [1, 0, 0, 1])
    np.testing.assert_array_equal(y[4], [1, 1, 0, 0])
    np.testing.assert_array_equal(y[6], [1, 1, 1, 1])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_raise(bad):
    z = _logits()
    z[4][1, 2] = bad
    with pytest.raises(ConfigError, match="exit 4: logits contain NaN or infinite values"):
        exit_signals(z, _hidden())
    with pytest.raises(ConfigError, match="exit 4: logits contain NaN"):
        argmaxes(z)


def test_non_finite_hidden_raises():
    h = _hidden()
    h[6][0, 0] = np.nan
    with pytest.raises(ConfigError, match="exit 6: hidden states contain NaN"):
        exit_signals(_logits(), h)


def test_empty_split_raises():
    with pytest.raises(ConfigError, match="empty split: no tokens"):
        exit_signals({1: np.zeros((0, 5))}, {1: np.zeros((0, 2))})


@pytest.mark.parametrize("case", ["logits_n", "logits_v", "hidden_n", "hidden_d", "keys"])
def test_shape_mismatch_raises(case):
    z, h = _logits(), _hidden()
    if case == "logits_n":
        z[4] = z[4][:3]
    elif case == "logits_v":
        z[4] = np.zeros((4, 6))
    elif case == "hidden_n":
        h[4] = h[4][:3]
    elif case == "hidden_d":
        h[4] = np.ones((4, 3))
    else:
        del h[6]
    with pytest.raises(ConfigError):
        exit_signals(z, h)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 12), st.integers(1, 3), st.data())
def test_signal_ranges(n, v, m, data):
    finite = st.floats(-60, 60, allow_nan=False, allow_infinity=False)
    logits = {k: data.draw(arrays(np.float64, (n, v), elements=finite)) for k in range(1, m + 1)}
    hidden = {k: data.draw(arrays(np.float64, (n, 3), elements=finite)) for k in range(1, m + 1)}
    for x in exit_signals(logits, hidden).values():
        top1, margin, entropy = x[:, COL["top1_prob"]], x[:, COL["margin"]], x[:, COL["entropy"]]
        assert ((top1 > 0) & (top1 <= 1)).all()
        assert ((margin >= 0) & (margin <= top1)).all()
        assert ((entropy >= 0) & (entropy <= math.log(v))).all()
        assert ((x[:, COL["agree_run"]] >= 0) & (x[:, COL["agree_run"]] < 1)).all()
        assert (np.abs(x[:, COL["cos_prev"]]) <= 1).all()


def test_last_exit_signals_equal_full_computation():
    from calibration.signals import exit_signals, last_exit_signals

    rng = np.random.default_rng(7)
    layers = [3, 6, 9, 12]
    # few distinct argmaxes so agreement runs occur
    logits = {k: rng.normal(size=(50, 5)) * 3 for k in layers}
    hidden = {k: rng.normal(size=(50, 8)) for k in layers}
    for upto in range(1, 5):
        sub = layers[:upto]
        full = exit_signals({k: logits[k] for k in sub}, {k: hidden[k] for k in sub}, num_exits=4)[sub[-1]]
        last = last_exit_signals({k: logits[k] for k in sub}, {k: hidden[k] for k in sub}, num_exits=4)
        assert np.array_equal(full, last)


def test_signals_from_graph_stats_equal_signals_from_logits():
    """The engine's rule reads softmax statistics computed in the segment graph (float32, torch /
    ONNX); they must give the calibration signals up to float32 rounding, ties included."""
    import torch

    from calibration.signals import last_exit_signals, signals_from_stats
    from edge.model.exits import exit_decision_stats

    rng = np.random.default_rng(11)
    layers = [3, 6, 9, 12]
    logits = {k: (rng.normal(size=(64, 300)) * rng.uniform(0.1, 20)).astype(np.float32) for k in layers}
    logits[3][0, :2] = 50.0  # a tie for the top: margin 0, argmax the lower id
    logits[6][:, 7] += 30.0  # a near-certain exit: top-1 probability ~1, entropy ~0
    hidden = {k: rng.normal(size=(64, 16)) for k in layers}
    stats, tokens = {}, {}
    for k in layers:
        s, t = exit_decision_stats(torch.from_numpy(logits[k]))
        stats[k], tokens[k] = s.numpy(), t.numpy()
    for upto in range(1, 5):
        sub = layers[:upto]
        ref = last_exit_signals({k: logits[k] for k in sub}, {k: hidden[k] for k in sub}, num_exits=4)
        got = signals_from_stats({k: stats[k] for k in sub}, {k: tokens[k] for k in sub},
                                 {k: hidden[k] for k in sub}, num_exits=4)
        assert np.allclose(got, ref, rtol=1e-5, atol=1e-6), upto
        assert np.array_equal(tokens[sub[-1]], np.argmax(logits[sub[-1]], axis=1))
    assert stats[3][0, 1] == 0.0 and tokens[3][0] == 0


def test_gated_signals_hand_computed_and_consistent():
    from calibration.signals import GATED_SIGNAL_NAMES, gated_signals, gated_signals_all_exits

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
