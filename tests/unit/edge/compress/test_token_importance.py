"""Token-importance skipping in prefill (edge/compress/token_importance.py), against references:
the full forward when nothing is skipped, a dense "freeze the skipped rows" forward when something is,
a per-head attention loop for the scores and a hand count for the FLOPs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from edge.compress.token_importance import (
    TokenImportanceConfig, attention_probs, attention_received, evaluate_token_importance, forced_mask,
    keep_count, prefill_flops, prefill_with_skipping, rank_average, select_kept, value_norm,
)
from edge.core.errors import ConfigError, RequestError
from edge.model.config import ModelConfig
from edge.model.decoder import Decoder, attention_mask
from edge.model.exits import ExitConfig, MultiExitModel
from tests.tolerance import assert_f32_close

SCORES = ("attention", "norm", "combined", "recency")


def tiny(seed: int = 0, **kw) -> Decoder:
    cfg = ModelConfig(**{**dict(vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                intermediate_size=96, max_position_embeddings=128), **kw})
    model = Decoder(cfg)
    model.init_weights(seed, std=0.1)  # larger than 0.02 so attention is peaked, not uniform
    return model.requires_grad_(False).eval()


def ids_of(t: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (1, t), generator=torch.Generator().manual_seed(seed))


def close(a, b, model: Decoder, what: str) -> None:
    # float32 paths that differ in summation order only: tests/tolerance.py, reductions up to the MLP width
    c = model.cfg
    assert_f32_close(a, b, reduction=max(c.hidden_size, c.intermediate_size), layers=c.num_layers, what=what)


# ---- references ---------------------------------------------------------------------------------

@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("skip, keep", [(1, 1.0), (2, 1.0), (4, 0.3)])  # keep all, or skip from past the last layer
@pytest.mark.parametrize("window", [None, 8])
def test_nothing_skipped_equals_full_forward(score, skip, keep, window):
    model = tiny(sliding_window=window)
    ids = ids_of(24)
    full = model(ids)
    res = prefill_with_skipping(model, ids, TokenImportanceConfig(skip, keep, score))
    assert bool(res.kept.all())
    close(res.logits, full.logits[:, -1], model, "last-token logits")
    for i in range(model.cfg.num_layers):
        close(res.keys[i], full.keys[i], model, f"keys of layer {i}")
        close(res.values[i], full.values[i], model, f"values of layer {i}")


def dense_freezing_reference(model: Decoder, ids: torch.Tensor, s: int, kept: torch.Tensor):
    """Every token through every layer, then skipped rows reset to their frozen state: the semantics
    prefill_with_skipping computes without running the skipped rows."""
    t = ids.shape[1]
    pos = torch.arange(t).unsqueeze(0)
    cos, sin = model.rope(pos)
    mask = attention_mask(pos, pos, window=model.cfg.sliding_window)
    h = model.embed(ids)
    keys, values = [], []
    for i, layer in enumerate(model.layers):
        if i == s:
            frozen = h
        out, k, v = layer(h, cos, sin, None, None, mask)
        h = out if i < s else torch.where(kept[None, :, None], out, frozen)
        keys.append(k)
        values.append(v)
    return model.head(h)[:, -1], keys, values, frozen


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("skip, keep, observe", [(1, 0.25, 0), (2, 0.5, 8), (3, 0.6, 0)])
def test_skipping_matches_dense_freezing_reference(score, skip, keep, observe):
    model = tiny(seed=1)
    ids = ids_of(30, seed=1)
    with torch.no_grad():
        res = prefill_with_skipping(model, ids, TokenImportanceConfig(skip, keep, score, keep_last=3,
                                                                      observe_last=observe))
        logits, keys, values, frozen = dense_freezing_reference(model, ids, skip, res.kept)
    assert not bool(res.kept.all())
    close(res.logits, logits, model, "last-token logits")
    close(res.frozen, frozen, model, "frozen hidden state")
    for i in range(model.cfg.num_layers):
        close(res.keys[i], keys[i], model, f"keys of layer {i}")
        close(res.values[i], values[i], model, f"values of layer {i}")


def test_skipped_tokens_kv_come_from_frozen_hidden_state():
    model = tiny(seed=2)
    ids = ids_of(32, seed=2)
    s = 2
    with torch.no_grad():
        full = model(ids)
        res = prefill_with_skipping(model, ids, TokenImportanceConfig(s, 0.4, "attention"))
        skipped = (~res.kept).nonzero()[:, 0]
        cos, sin = model.rope(skipped[None])
        h_s = full.hidden_states[s]  # layers before s run on every token, as in the full forward
        close(res.frozen, h_s, model, "frozen = hidden state entering layer s")
        close(res.keys[s], full.keys[s], model, "layer s K of every token")  # its input is still unchanged
        for i in range(s, model.cfg.num_layers):
            k, v = model.layers[i].kv_only(h_s[:, skipped], cos, sin)
            close(res.keys[i][:, :, skipped], k, model, f"skipped keys, layer {i}")
            close(res.values[i][:, :, skipped], v, model, f"skipped values, layer {i}")
    # deeper kept tokens read the skipped tokens' propagated K/V, so the result is not the full forward
    assert not torch.allclose(res.logits, full.logits[:, -1], rtol=1e-3, atol=1e-4)


def test_multi_exit_model_and_continuation_on_the_cache():
    model = tiny(seed=3)
    wrapped = MultiExitModel(model, ExitConfig(layers=[2, 4], adapter_rank=0))
    ids = ids_of(20, seed=3)
    res = prefill_with_skipping(wrapped, ids[:, :16], TokenImportanceConfig(2, 1.0, "combined"))
    with torch.no_grad():
        cont = model(ids[:, 16:], past=res.cache).logits
    close(cont, model(ids).logits[:, 16:], model, "continuation on the prefill cache")


# ---- budget ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [5, 10, 37, 64])
@pytest.mark.parametrize("frac", [0.05, 0.3, 0.5, 0.77, 1.0])
def test_budget_and_forced_tokens(t, frac):
    cfg = TokenImportanceConfig(1, frac, keep_last=4, keep_first=2)
    scores = torch.rand(t, generator=torch.Generator().manual_seed(t))
    kept = select_kept(scores, cfg)
    forced = forced_mask(t, cfg)
    assert int(forced.sum()) == min(t, 6)
    assert int(kept.sum()) == keep_count(t, cfg) == min(t, max(math.ceil(round(frac * t, 6)), int(forced.sum())))
    assert bool(kept[forced].all())
    free_kept, free_skipped = scores[kept & ~forced], scores[~kept]
    if free_kept.numel() and free_skipped.numel():
        assert float(free_kept.min()) > float(free_skipped.max())  # the highest scores win


def test_budget_in_prefill():
    model = tiny()
    res = prefill_with_skipping(model, ids_of(40), TokenImportanceConfig(2, 0.3, keep_last=5, keep_first=1))
    assert int(res.kept.sum()) == 12 and bool(res.kept[:1].all()) and bool(res.kept[-5:].all())
    assert res.kept_per_layer == [40, 40, 12, 12]
    recent = prefill_with_skipping(model, ids_of(40), TokenImportanceConfig(2, 0.3, "recency", keep_last=5))
    assert recent.kept.nonzero()[:, 0].tolist() == [0, *range(29, 40)]  # the sink, then the latest 11


# ---- FLOPs --------------------------------------------------------------------------------------

def test_prefill_flops_hand_count():
    cfg = ModelConfig(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=12)  # head_dim 4: q/o width 8, k/v width 4
    # head 2*8*10 = 160
    # layer 0, 4 of 4 tokens: q 2*4*8*8=512, k+v 2*4*8*8=512, o 512, MLP 3*2*4*8*12=2304, attention 2*2*4*4*8=512
    # layer 1, 2 of 4: q 256, k+v 256, o 256, MLP 1152, attention 2*2*2*4*8=256, kv_only 2*2*8*8=256
    assert prefill_flops(cfg, 4, [4, 2]) == 160 + 4352 + 2432
    with pytest.raises(ConfigError, match="kept_per_layer"):
        prefill_flops(cfg, 4, [4])
    with pytest.raises(ConfigError, match="kept_per_layer"):
        prefill_flops(cfg, 4, [4, 5])


def test_flops_saved_grows_as_keep_fraction_falls():
    model = tiny()
    ids = ids_of(48)
    saved = [prefill_with_skipping(model, ids, TokenImportanceConfig(1, f, "combined")).flops_saved_frac
             for f in (1.0, 0.75, 0.5, 0.25)]
    assert saved[0] <= 0  # nothing skipped: the scoring is pure overhead
    assert 0 < saved[1] < saved[2] < saved[3] < 1
    res = prefill_with_skipping(model, ids, TokenImportanceConfig(1, 0.5))
    assert res.full_flops == prefill_flops(model.cfg, 48, [48] * 4)


# ---- scores -------------------------------------------------------------------------------------

def test_attention_probs_match_a_per_head_loop():
    g = torch.Generator().manual_seed(0)
    b, h, kvh, t, hd = 2, 6, 2, 9, 8
    q, k = torch.randn(b, h, t, hd, generator=g), torch.randn(b, kvh, t, hd, generator=g)
    pos = torch.arange(t).unsqueeze(0).expand(b, t)
    mask = attention_mask(pos, pos)
    probs = attention_probs(q, k, mask)
    for head in range(h):
        kv = head // (h // kvh)  # GQA: consecutive query heads share a KV head
        s = (q[:, head] @ k[:, kv].transpose(-1, -2)) / math.sqrt(hd)
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
        torch.testing.assert_close(probs[:, head], torch.softmax(s, -1), rtol=1e-5, atol=1e-6)


def test_attention_received_normalises_by_visible_queries():
    t, j = 16, 14
    probs = torch.zeros(1, 2, t, t)
    for q in range(t):
        if q >= j:
            probs[0, :, q, j] = 1.0  # every query that can see token j looks only at it
        else:
            probs[0, :, q, :q + 1] = 1.0 / (q + 1)  # the others spread uniformly
    pos = torch.arange(t).unsqueeze(0)
    received = attention_received(probs, attention_mask(pos, pos))[0]
    assert int(received.argmax()) == j and float(received[j]) == pytest.approx(1.0)
    assert int(probs.sum(dim=(1, 2))[0].argmax()) == 0  # raw sums would favour the first token
    last4 = attention_received(probs, attention_mask(pos, pos), last=4)[0]  # queries 12..15; 14, 15 see j
    assert int(last4.argmax()) == j and float(last4[j]) == pytest.approx(1.0)
    assert float(last4[0]) == pytest.approx((1 / 13 + 1 / 14) / 4)
    cfg = TokenImportanceConfig(1, 0.1, "attention", keep_last=1, keep_first=0)
    assert bool(select_kept(received, cfg)[j])


def test_attention_scores_equal_a_direct_attention_matrix():
    model = tiny(seed=4)
    ids = ids_of(20, seed=4)
    res = prefill_with_skipping(model, ids, TokenImportanceConfig(1, 0.5, "attention"))
    with torch.no_grad():  # layer 0's attention written out from its modules
        att, x = model.layers[0].self_attn, model.layers[0].input_layernorm(model.embed(ids))
        q = att.q_proj(x).view(1, 20, 4, 16).transpose(1, 2)
        cos, sin = model.rope(torch.arange(20)[None])
        from edge.model.decoder import apply_rope
        q, k = apply_rope(q, cos, sin), att.kv(x, cos, sin)[0]
        direct = torch.stack([torch.softmax((q[0, h] @ k[0, h // 2].T / 4.0).masked_fill(
            ~torch.ones(20, 20, dtype=torch.bool).tril(), -torch.inf), -1) for h in range(4)])  # [H, T, T]
    expected = direct.sum(dim=(0, 1)) / (4 * torch.arange(20, 0, -1))
    torch.testing.assert_close(res.scores, expected, rtol=1e-4, atol=1e-6)


def test_rank_average_and_value_norm():
    a, b = torch.tensor([[0.1, 5.0, 0.3, 0.2]]), torch.tensor([[1.0, 9.0, 3.0, 2.0]])
    r = rank_average(a * 1000, b)
    assert int(r.argmax()) == 1 and torch.equal(r, rank_average(a, b))  # scale-free
    v = torch.zeros(1, 2, 3, 4)
    v[0, :, 1] = 3.0  # token 1: norm 6 in both heads
    assert value_norm([v, v]).tolist() == [[0.0, 6.0, 0.0]]


# ---- evaluation and errors ------------------------------------------------------------------------

def test_evaluate_reports_quality_and_flops():
    model = tiny(seed=5)
    windows = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    same = evaluate_token_importance(model, windows, TokenImportanceConfig(2, 1.0), continuation=8)
    assert same.kl_mean == pytest.approx(0.0, abs=1e-5) and same.top1_agreement == 1.0
    assert same.ppl_ratio == pytest.approx(1.0, rel=1e-4) and same.cont_top1_agreement == 1.0
    rep = evaluate_token_importance(model, windows.numpy(), TokenImportanceConfig(1, 0.25, keep_last=4), continuation=8)
    assert rep.prompt_len == 32 and rep.kept_per_layer == [32, 8, 8, 8] and rep.flops_saved_frac > 0.3
    assert rep.kl_mean > 0 and math.isfinite(rep.ppl_skip) and rep.ppl_full == pytest.approx(same.ppl_full)
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["config"]["score"] == "combined" and d["n_windows"] == 3


@pytest.mark.parametrize("kw, field", [
    (dict(skip_from_layer=0, keep_fraction=0.5), "skip_from_layer"),
    (dict(skip_from_layer=1.5, keep_fraction=0.5), "skip_from_layer"),
    (dict(skip_from_layer=2, keep_fraction=0.0), "keep_fraction"),
    (dict(skip_from_layer=2, keep_fraction=1.5), "keep_fraction"),
    (dict(skip_from_layer=2, keep_fraction=float("nan")), "keep_fraction"),
    (dict(skip_from_layer=2, keep_fraction=0.5, score="entropy"), "score"),
    (dict(skip_from_layer=2, keep_fraction=0.5, keep_last=0), "keep_last"),
    (dict(skip_from_layer=2, keep_fraction=0.5, keep_first=-1), "keep_first"),
    (dict(skip_from_layer=2, keep_fraction=0.5, observe_last=-2), "observe_last"),
    (dict(skip_from_layer=True, keep_fraction=0.5), "skip_from_layer"),
])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError, match=f"token_importance.{field}"):
        TokenImportanceConfig(**kw)


def test_errors_against_the_model_and_inputs():
    model = tiny()
    with pytest.raises(ConfigError, match="past the model's 4 layers"):
        prefill_with_skipping(model, ids_of(10), TokenImportanceConfig(5, 0.5))
    with pytest.raises(RequestError, match=r"\[1, T\]"):
        prefill_with_skipping(model, ids_of(10).expand(2, 10), TokenImportanceConfig(2, 0.5))
    with pytest.raises(ConfigError, match="continuation"):
        evaluate_token_importance(model, torch.zeros(2, 10, dtype=torch.long), TokenImportanceConfig(2, 0.5), 10)
