"""The teacher-forced window loop (edge.model.windows): rows, batches, judged positions, metrics."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge.core.errors import ConfigError
from edge.model.config import ModelConfig
from edge.model.decoder import Decoder
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.windows import exit_metrics, random_windows, read_exits, stream_windows, teacher_forced

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
                  max_position_embeddings=64)


def _model(seed: int = 0) -> MultiExitModel:
    dec = Decoder(CFG)
    dec.init_weights(seed, std=0.3)
    return MultiExitModel(dec.eval(), ExitConfig(layers=[1, 2, 4], adapter_rank=0)).eval()


def test_stream_windows_cut_the_stream_into_overlapping_by_one_rows():
    rows = stream_windows(np.arange(10), seq_len=3, max_windows=5)
    assert rows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]] and rows.dtype == np.int64
    assert stream_windows(np.arange(10), 3, 2).shape == (2, 4)
    with pytest.raises(ConfigError, match="empty split: 3 tokens"):
        stream_windows(np.arange(3), 3, 5)


def test_random_windows_depend_on_seed_and_step_only():
    tokens = np.arange(1000)
    a = random_windows(tokens, 7, 3, 4, 16)
    assert a.shape == (4, 17) and a.dtype == torch.int64
    assert torch.equal(a, random_windows(tokens, 7, 3, 4, 16))
    assert not torch.equal(a, random_windows(tokens, 7, 4, 4, 16))
    assert ((a[:, 1:] - a[:, :-1]) == 1).all()  # contiguous slices of the stream


def test_teacher_forced_reads_all_rows_in_batches():
    m = _model()
    rows = np.random.default_rng(0).integers(0, 64, (5, 9))
    passes = list(teacher_forced(m.backbone, rows, batch=2))
    assert [ids.shape[0] for ids, _ in passes] == [2, 2, 1]
    assert np.array_equal(torch.cat([ids for ids, _ in passes]).numpy(), rows)
    for ids, out in passes:
        assert out.logits.shape == (ids.shape[0], 8, 64)  # the first L - 1 tokens are read
    with pytest.raises(ConfigError, match=r"expected token ids \[N >= 1, L >= 2\]"):
        next(teacher_forced(m.backbone, np.zeros((0, 4)), 2))


def test_teacher_forced_without_the_head_reads_the_same_states():
    """``logits=False`` (exit_metrics, read_exits: they read the head at the judged positions only) skips the
    LM head over every position and nothing else."""
    m = _model()
    rows = np.random.default_rng(2).integers(0, 64, (3, 9))
    (_, full), = teacher_forced(m.backbone, rows, batch=3)
    (_, lean), = teacher_forced(m.backbone, rows, batch=3, logits=False)
    assert lean.logits is None and full.logits is not None
    for a, b in zip(full.hidden_states + full.keys + full.values, lean.hidden_states + lean.keys + lean.values):
        assert torch.equal(a, b)
    assert torch.equal(m.backbone.head(lean.hidden_states[-1]), full.logits)


def test_exit_metrics_hand_computed_on_the_judged_positions():
    """Accuracy, agreement and perplexity of positions first..L-2, recomputed directly."""
    m = _model(1)
    rows = np.random.default_rng(1).integers(0, 64, (3, 10))
    first = 4
    got = exit_metrics(m, rows, first=first, batch=2)
    with torch.no_grad():
        logits = m(torch.from_numpy(rows[:, :-1]))  # {exit: [3, 9, V]}
    target = torch.from_numpy(rows[:, first + 1:])
    judged = {k: v[:, first:] for k, v in logits.items()}
    n = target.numel()
    assert got["tokens"] == n == 3 * 5
    for k in (1, 2, 4):
        top = judged[k].argmax(-1)
        assert got["exit_accuracy"][str(k)] == (top == target).sum().item() / n
        assert got["exit_agreement"][str(k)] == (top == judged[4].argmax(-1)).sum().item() / n
    nll = F.cross_entropy(judged[4].reshape(-1, 64), target.reshape(-1), reduction="sum").item()
    assert got["heldout_ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert got["heldout_top1"] == got["exit_accuracy"]["4"] and got["exit_agreement"]["4"] == 1.0


def test_exit_metrics_do_not_depend_on_the_batch():
    m = _model(2)
    rows = np.random.default_rng(2).integers(0, 64, (6, 12))
    one, many = exit_metrics(m, rows, batch=1), exit_metrics(m, rows, batch=4)
    assert one["heldout_ppl"] == pytest.approx(many["heldout_ppl"], rel=1e-5)  # float32 sums in another order
    assert {k: v for k, v in one.items() if k != "heldout_ppl"} == {k: v for k, v in many.items() if k != "heldout_ppl"}


def test_read_exits_gives_what_the_exits_give_at_the_judged_positions():
    m = _model(3)
    rows = np.random.default_rng(3).integers(0, 64, (3, 7))
    parts = list(read_exits(m, rows, first=2, batch=2))
    assert [len(p.tokens[4]) for p in parts] == [2 * 4, 1 * 4]  # rows x judged positions, flattened
    with torch.no_grad():
        logits = m(torch.from_numpy(rows[:, :-1]))
    for k in (1, 2, 4):
        tokens = np.concatenate([p.tokens[k] for p in parts])
        assert np.array_equal(tokens, logits[k][:, 2:].argmax(-1).reshape(-1).numpy())
        top1 = np.concatenate([p.stats[k][:, 0] for p in parts])
        np.testing.assert_allclose(top1, torch.softmax(logits[k][:, 2:], -1).amax(-1).reshape(-1).numpy(), rtol=1e-5)
    assert parts[0].gates == {} and parts[0].hidden[1].shape == (8, 32)
