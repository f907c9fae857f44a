"""Free-running evaluation: every generated token checked against the full model on the same prefix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from calibration.collect import Collected
from edge.core.errors import ConfigError
from edge.model.config import ModelConfig
from edge.model.decoder import Decoder
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.reference import reference_generate
from edge.pipeline.freerun import FreeRun, check_continuations, free_run
from edge.runtime.engine import KVMode
from edge.runtime.rules import NeverExit


def _hand_run() -> FreeRun:
    """2 prompts of 2 tokens, 3 generated each (the first from the prefill, not judged), 3 layers.

    unit 0: generated 20 21 22, decided at layers 3 1 3; the full model says 21 then 99 on those prefixes:
            21 exited early and is right, 22 ran full depth and is wrong (a full-depth mismatch).
    unit 1: generated 30 31 32, decided at layers 3 2 1; the full model says 77 then 32:
            31 exited early and is wrong (a false exit), 32 exited early and is right.
    """
    seqs = np.array([[10, 11, 20, 21, 22], [12, 13, 30, 31, 32]])
    exit_layers = np.array([[3, 1, 3], [3, 2, 1]])
    full = np.array([21, 99, 77, 32])  # the full model's token at each judged position, unit by unit
    argmax = {1: np.zeros(4, np.int64), 2: np.zeros(4, np.int64), 3: full}
    data = Collected([1, 2, 3], {k: np.zeros((4, 6)) for k in argmax}, argmax, np.zeros(4, np.int64),
                     np.array([0, 0, 1, 1]), 2)
    return FreeRun(KVMode.PROPAGATE, 3, seqs, exit_layers, data)


def test_wrong_tokens_hand_computed():
    run = _hand_run()
    fe, mm = run.wrong()
    assert fe.tolist() == [[False, False], [True, False]]
    assert mm.tolist() == [[False, True], [False, False]]
    assert run.unit_losses().tolist() == [0.5, 0.5]


def test_summary_hand_computed():
    s = _hand_run().summary()
    assert (s.prompts, s.tokens, s.false_exits, s.full_depth_mismatches) == (2, 4, 1, 1)
    assert s.false_exit_rate == 0.5 and s.exited_frac == 0.75  # judged exits 1, 3, 2, 1
    assert s.mean_exit_layer == pytest.approx(7 / 4)
    assert s.layers_skipped_frac == pytest.approx((2 + 0 + 1 + 2) / 3 / 4)
    assert s.kv_mode == "propagate"


def test_concat_keeps_units_in_order():
    a, b = _hand_run(), _hand_run()
    both = FreeRun.concat([a, b])
    assert both.seqs.shape == (4, 5) and both.data.n_units == 4
    assert both.data.unit.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert both.unit_losses().tolist() == [0.5, 0.5, 0.5, 0.5]


CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
                  max_position_embeddings=64)


def _model() -> MultiExitModel:
    torch.manual_seed(0)
    dec = Decoder(CFG)
    dec.init_weights(0, std=0.3)
    return MultiExitModel(dec.eval(), ExitConfig(layers=[2, 4], adapter_rank=0)).eval()


def test_check_continuations_finds_exactly_the_token_that_differs():
    m = _model()
    prompts = np.array([[1, 2, 3], [4, 5, 6]])
    greedy = np.array([reference_generate(m, p.tolist(), 6).tokens for p in prompts])  # full depth
    layers = np.full(greedy.shape, 4)
    layers[0, 1:] = 2  # unit 0's decode tokens "exited" at layer 2
    clean = check_continuations(m, prompts, greedy, layers, KVMode.DEFER).summary()
    assert (clean.tokens, clean.false_exits, clean.full_depth_mismatches) == (10, 0, 0)
    bad = greedy.copy()
    bad[:, -1] = (bad[:, -1] + 1) % 64  # the last token of each unit: no judged prefix contains it
    run = check_continuations(m, prompts, bad, layers, KVMode.DEFER)
    fe, mm = run.wrong()
    assert fe.tolist() == [[False] * 4 + [True], [False] * 5]  # unit 0's last token exited early
    assert mm.tolist() == [[False] * 5, [False] * 4 + [True]]  # unit 1's ran full depth
    assert run.unit_losses().tolist() == [0.2, 0.2]
    with pytest.raises(ConfigError, match="at least 2 new tokens"):
        check_continuations(m, prompts, greedy[:, :1], layers[:, :1], KVMode.DEFER)
    with pytest.raises(ConfigError, match="expected prompts"):
        check_continuations(m, prompts, greedy, layers[:, :3], KVMode.DEFER)


def test_free_run_at_full_depth_is_greedy_and_never_wrong():
    m = _model()
    prompts = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    run = free_run(m, prompts, 5, NeverExit(), KVMode.DEFER, batch=2)
    assert run.seqs[:, 3:].tolist() == [reference_generate(m, p.tolist(), 5).tokens for p in prompts]
    s = run.summary()
    assert (s.prompts, s.tokens, s.false_exits, s.full_depth_mismatches, s.exited_frac) == (3, 12, 0, 0, 0.0)
    assert s.layers_skipped_frac == 0.0 and run.data.n_units == 3
