"""The static-cache decode step (edge/runtime/static_decode.py) on the CPU: the tokens of the reference
generator at full depth, each exit's argmax as the teacher-forced model gives it, and state
propagation after an exit as the reference generator does it. CUDA graph capture itself needs a GPU:
deploy/gpu_check.py exercises it there; here ``capture`` must refuse."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from calibration.collect import collect_units
from edge.core.errors import ConfigError
from edge.model.reference import reference_generate
from edge.runtime.static_decode import StaticDecode
from tests.unit.edge.runtime.test_engine import _model


def _prompts(b: int, p: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 300, (b, p)))


def _greedy(sd: StaticDecode, prompts: torch.Tensor, n: int, exit_after: int | None = None) -> np.ndarray:
    tok = sd.prefill(prompts)
    out = [tok]
    for _ in range(n - 1):
        tok = sd.step(tok, exit_after)
        out.append(tok)
    return torch.stack(out, 1).numpy()


def test_full_depth_is_the_reference_generator():
    m = _model(seed=3)
    prompts = _prompts(3, 7, 0)
    got = _greedy(StaticDecode(m, 3, 32), prompts, 10)
    ref = [reference_generate(m, p.tolist(), 10).tokens for p in prompts]
    assert got.tolist() == ref


def test_each_exit_token_is_the_teacher_forced_exit_argmax():
    m = _model(seed=5)
    prompts = _prompts(2, 6, 1)
    sd = StaticDecode(m, 2, 24)
    greedy = _greedy(sd, prompts, 8)  # full depth: fills every layer's cache
    seqs = np.concatenate([prompts.numpy(), greedy], 1)
    tf = collect_units(m, seqs, 6)  # every exit's argmax on every judged prefix
    # re-run the same prefixes segment by segment and read each exit
    sd2 = StaticDecode(m, 2, 24)
    sd2.prefill(prompts)
    for t in range(greedy.shape[1] - 1):
        sd2.ids.copy_(torch.from_numpy(greedy[:, t:t + 1]))
        out = None
        for i, layer in enumerate(m.exit_layers):
            if i > 0:
                sd2.hidden_in[i].copy_(out.hidden)
            out = sd2.segment(i)
            want = tf.argmax[layer].reshape(2, -1)[:, t]
            assert out.token.tolist() == want.tolist(), (t, layer)
        sd2.pos.add_(1)


def test_exit_with_state_propagation_matches_the_reference_generator():
    """Every token leaves after the first exit; the skipped layers' K/V come from their projections of the
    exit's residual, as reference_generate's state propagation does."""
    from edge.runtime.rules import ConfidenceRule

    m = _model(seed=7)
    prompts = _prompts(2, 5, 2)
    got = _greedy(StaticDecode(m, 2, 20), prompts, 8, exit_after=0)
    for row, p in zip(got, prompts):
        ref = reference_generate(m, p.tolist(), 8, rule=ConfidenceRule(0.0))
        assert row.tolist() == ref.tokens
        assert set(ref.exit_layers[1:]) == {m.exit_layers[0]}


def test_bad_shapes_and_capture_without_cuda():
    m = _model(seed=1)
    with pytest.raises(ConfigError, match="max_len"):
        StaticDecode(m, 1, 10_000)
    sd = StaticDecode(m, 2, 16)
    with pytest.raises(ConfigError, match="prompts must be"):
        sd.prefill(_prompts(3, 4, 0))
    with pytest.raises(ConfigError, match="CUDA device"):
        sd.capture()


def test_bfloat16_steps_write_the_cache_in_its_dtype():
    """A half-precision model (the 8B-shaped check on a GPU runs bf16): rotary tables are cast, so
    index_put_ gets K/V of the cache's dtype (it refuses mixed dtypes)."""
    m = _model(seed=2).to(torch.bfloat16)
    sd = StaticDecode(m, 2, 16)
    got = _greedy(sd, _prompts(2, 5, 1), 4, exit_after=0)
    assert got.shape == (2, 4) and sd.keys[0].dtype == torch.bfloat16
