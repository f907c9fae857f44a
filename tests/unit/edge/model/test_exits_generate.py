"""Multi-exit model, distillation loop and the reference early-exit generator."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge.core.artifacts import atomic_dir
from edge.model.config import preset
from edge.training.config import DistillConfig
from edge.training.distill import distill_loss, train_exits
from edge.core.errors import CheckpointError, ConfigError, SmartExitError
from edge.model.exits import ExitConfig, MultiExitModel, load_multi_exit, save_multi_exit
from edge.model.reference import _decode_step, reference_generate
from edge.model.checkpoint import load_decoder
from edge.model.decoder import Decoder
from tests.conftest import SMALL, make_hf_checkpoint
from tests.tolerance import assert_f32_close


def _model(seed=0, layers=(1, 2, 3, 4), rank=4) -> MultiExitModel:
    dec = Decoder(preset("micro"))
    dec.init_weights(seed, std=0.2)  # large std -> peaked, non-trivial predictions
    return MultiExitModel(dec.eval(), ExitConfig(layers=list(layers), adapter_rank=rank)).eval()


class _ExitAt:
    """An engine exit rule (edge/runtime/rules.py) that stops at the given layers."""

    def __init__(self, *layers):
        self.layers = layers

    def decide(self, layer, stats, tokens, hidden):
        return np.full(len(tokens[layer]), layer in self.layers)


def _greedy_no_cache(dec: Decoder, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(dec(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_exit_config_validation():
    with pytest.raises(ConfigError, match="strictly increasing"):
        ExitConfig(layers=[6, 3])
    with pytest.raises(ConfigError, match="past the model"):
        ExitConfig(layers=[3, 20]).resolved(12)
    assert ExitConfig(layers=[3, 6]).resolved(12) == [3, 6, 12]


def test_every_exit_is_the_transformers_model_cut_at_that_layer(tmp_path):
    """Against `transformers` on the same weights: the last exit is the model's output, and an exit
    with an untrained adapter is the final norm and LM head on the hidden state after its layer."""
    import transformers

    folder = make_hf_checkpoint(tmp_path / "llama", "llama", seed=2, initializer_range=0.2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    m = MultiExitModel(load_decoder(folder), ExitConfig(layers=[1, 2, 3], adapter_rank=4)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        got = m(ids)
        expected = {k: hf.lm_head(hf.model.norm(ref.hidden_states[k])) for k in (1, 2, 3)}
    expected[4] = ref.logits
    assert sorted(got) == [1, 2, 3, 4]
    for k, want in expected.items():
        # two implementations, k layers of dot products up to the MLP width long (tests/tolerance.py)
        assert_f32_close(got[k].numpy(), want.numpy(), SMALL["intermediate_size"], k + 1, f"exit {k}")


def test_untrained_adapter_is_plain_final_head():
    m = _model()
    h = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert torch.allclose(m.exit_logits(2, h), m.backbone.head(h))


def test_generation_with_exits_disabled_is_full_greedy():
    m = _model(seed=3)
    prompt = [5, 17, 99, 3, 42]
    out = reference_generate(m, prompt, 24)
    assert out.tokens == _greedy_no_cache(m.backbone, prompt, 24)
    assert set(out.exit_layers) == {4}


def test_always_exit_rule_exits_at_first_exit():
    m = _model(seed=3)
    out = reference_generate(m, [1, 2, 3], 10, rule=_ExitAt(1, 2, 3))
    assert out.exit_layers[0] == 4  # the first token comes from the full-depth prefill
    assert out.exit_layers[1:] == [1] * 9


def test_state_propagation_fills_skipped_layers_from_exit_hidden():
    m = _model(seed=4)
    bb = m.backbone
    prompt = [7, 8, 9]
    out = bb(torch.tensor([prompt]))
    keys, values = list(out.keys), list(out.values)
    tok = int(out.logits[0, -1].argmax())
    with torch.no_grad():
        _, layer = _decode_step(m, tok, len(prompt), keys, values, _ExitAt(2))
        assert layer == 2
        # recompute the exit hidden state after layer 2 for the new token, with the prompt as past
        full = bb(torch.tensor([prompt + [tok]]))
        h2 = full.hidden_states[2][:, -1:]
        cos, sin = bb.rope(torch.tensor([[len(prompt)]]))
        # one position vs the whole sequence: summation order only (tests/tolerance.py)
        for j in (2, 3):
            k, v = bb.layers[j].kv_only(h2, cos, sin)
            assert_f32_close(keys[j][:, :, -1:], k, 64, 3, f"key {j}")
            assert_f32_close(values[j][:, :, -1:], v, 64, 3, f"value {j}")
        for j in (0, 1):  # layers that ran hold the true keys
            assert_f32_close(keys[j][:, :, -1:], full.keys[j][:, :, -1:], 64, j + 1, f"key {j}")


def test_stop_token_and_lengths():
    m = _model(seed=3)
    prompt = [5, 17, 99]
    first = reference_generate(m, prompt, 5).tokens[0]
    out = reference_generate(m, prompt, 5, stop_ids=[first])
    assert out.tokens == [first] and out.stopped == "stop_token"


@pytest.mark.parametrize("prompt,n,msg", [
    ([], 4, "empty prompt"),
    ([1, 300], 4, "outside the vocabulary"),
    ([1] * 120, 16, "exceeds the context window of 128"),
])
def test_bad_prompts(prompt, n, msg):
    with pytest.raises(SmartExitError, match=msg):
        reference_generate(_model(), prompt, n)


def test_distill_loss_zero_when_student_equals_teacher_and_kl_only():
    t = torch.randn(6, 10)
    assert distill_loss(t, t, torch.zeros(6, dtype=torch.long), 2.0, 1.0).abs().item() < 1e-6


@pytest.mark.slow  # 3-6 s: trains the exit heads
def test_distillation_improves_agreement_and_keeps_backbone():
    m = _model(seed=5, layers=(1, 4), rank=8)
    before = {k: v.clone() for k, v in m.backbone.state_dict().items()}
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, 5000).astype(np.uint16)
    x = torch.from_numpy(tokens[:129].astype(np.int64)).unsqueeze(0)

    def agreement():
        with torch.no_grad():
            out = m(x)
        return (out[1].argmax(-1) == out[4].argmax(-1)).float().mean().item()

    a0 = agreement()
    losses = train_exits(m, tokens, DistillConfig(steps=60, batch_size=4, seq_len=32, lr=1e-2, kl_weight=1.0))
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    assert agreement() > a0
    for k, v in m.backbone.state_dict().items():
        assert torch.equal(v, before[k]), f"frozen backbone changed: {k}"


def test_multi_exit_checkpoint_roundtrip_and_tamper(tmp_path):
    m = _model(seed=6)
    with torch.no_grad():
        for p in m.heads.parameters():
            p.add_(0.01)
        for p in m.backbone.parameters():  # the checkpoint stores the backbone in fp16
            p.copy_(p.half().float())
    folder = tmp_path / "me"
    with atomic_dir(folder) as tmp:
        save_multi_exit(m, tmp, tokenizer=None, metrics={"a": 1}, source={})
    loaded = load_multi_exit(folder)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        a, b = m(ids), loaded(ids)
    for k in m.exit_layers:  # the same weights through the same code
        assert_f32_close(a[k], b[k], 64, k, f"exit {k}")
    f = folder / "exits.safetensors"
    f.write_bytes(f.read_bytes()[:-4] + b"abcd")
    with pytest.raises(CheckpointError, match="does not match"):
        load_multi_exit(folder)


def test_not_a_multi_exit_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a multi-exit checkpoint"):
        load_multi_exit(tmp_path)
