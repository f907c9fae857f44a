"""Our decoder against `transformers` on the same random weights (tests the shape logic too)."""
from __future__ import annotations

import pytest
import torch

from tests.tolerance import assert_f32_close

from edge.model.checkpoint import load_decoder
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.reference import reference_generate
from tests.conftest import make_hf_checkpoint

# fp32 on CPU: both implementations do the same math in a different order.

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

CASES = {
    "llama": dict(family="llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, tie_word_embeddings=False),
    "llama_tied_bias": dict(family="llama", tie_word_embeddings=True, attention_bias=True),
    "qwen2": dict(family="qwen2", tie_word_embeddings=True),
    "mistral": dict(family="mistral", sliding_window=24, tie_word_embeddings=False),
    # Llama-3.1-8B config.json as published, with depth and widths scaled down
    # (32 -> 2 layers, 4096 -> 512 hidden, 32/8 -> 4/1 heads keeping head_dim 128 and
    # the 4:1 GQA ratio, 14336 -> 1792 MLP, 128256 -> 1024 vocab).
    "llama31_8b_scaled": dict(
        family="llama", hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, intermediate_size=1792, vocab_size=1024, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
    ),
}


def _pair(tmp_path, name):
    kw = dict(CASES[name])
    family = kw.pop("family")
    folder = make_hf_checkpoint(tmp_path / name, family, seed=1, **kw)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf, load_decoder(folder)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    hf, ours = _pair(tmp_path, name)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert_f32_close(got.numpy(), ref.numpy(), ours.cfg.hidden_size, ours.cfg.num_layers + 1, name)


def test_long_positions_use_llama3_scaling(tmp_path):
    """Positions past the original 8192-token window, where Llama-3 RoPE scaling matters."""
    hf, ours = _pair(tmp_path, "llama31_8b_scaled")
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20000, 20016).unsqueeze(0)
    with torch.no_grad():
        ref = hf(ids, position_ids=pos).logits
        got = ours(ids, positions=pos).logits
    assert_f32_close(got.numpy(), ref.numpy(), ours.cfg.hidden_size, ours.cfg.num_layers + 1, "long positions")
    assert ours.cfg.rope.rope_type == "llama3"


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama31_8b_scaled"])
def test_32_greedy_tokens_identical(tmp_path, name):
    hf, ours = _pair(tmp_path, name)
    prompt = torch.randint(0, ours.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, 12:].tolist()
    model = MultiExitModel(ours, ExitConfig(layers=[1, ours.cfg.num_layers]))
    got = reference_generate(model, prompt[0].tolist(), 32)  # exits disabled: full depth with KV cache
    assert got.tokens == ref
    assert got.exit_layers == [ours.cfg.num_layers] * 32
