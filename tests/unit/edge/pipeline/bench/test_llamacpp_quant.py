"""llama.cpp at our bit-widths (edge/pipeline/bench/llamacpp_gguf.py, llamacpp_quality.py): quantization
types, cache names and the perplexity arithmetic everywhere; llama.cpp's quantizer, the stored tensor types
and the peer's perplexity against our decoder where `make llamacpp` has installed it."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from edge.core.errors import ConfigError, SmartExitError
from edge.model.bundled import BUNDLED_DIR, BUNDLED_EE_DIR
from edge.pipeline.bench import llamacpp as lc
from edge.pipeline.bench import llamacpp_gguf as gg
from edge.pipeline.bench import llamacpp_peer as lp
from edge.pipeline.bench import llamacpp_quality as lq
from tests.conftest import make_hf_checkpoint

REASON = lc.available()
needs_llamacpp = pytest.mark.skipif(REASON is not None, reason=REASON or "")


# ------------------------------------------------------------------ pure: names, cache files, arithmetic
@pytest.mark.parametrize("given, canonical", [
    ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_K_M", "q4_K_M"), ("q4_K", "q4_K_M"), ("Q4_K_M", "q4_K_M"),
    ("Q8_0", "q8_0"), ("q4_k", "q4_K_M"),
])
def test_qtype_names_and_alias(given, canonical):
    assert gg.canonical_qtype(given) == canonical


@pytest.mark.parametrize("bad", ["q3_K", "f32", "int4", "", "q4_K_S"])
def test_unknown_qtype_names_the_allowed_ones(bad):
    with pytest.raises(ConfigError, match="q8_0.*q4_0.*q4_K_M"):
        gg.canonical_qtype(bad)


def test_every_qtype_is_a_llamacpp_ftype_constant():
    """The ftype names are llama.h's; checked against the installed bindings where they exist."""
    assert set(gg.QTYPE_ALIASES.values()) <= set(gg.QTYPES)
    if REASON is None:
        import llama_cpp

        assert {q: getattr(llama_cpp, name) for q, name in gg.QTYPES.items()} == {"q8_0": 7, "q4_0": 2, "q4_K_M": 15}


def test_quantized_file_is_named_after_its_cached_source(monkeypatch, tmp_path):
    monkeypatch.setattr(gg, "llamacpp_version", lambda: "9.9.9")
    src = gg.gguf_path(tmp_path, BUNDLED_EE_DIR, "f32")
    q4 = gg.quantized_gguf_path(src, "q4_K")
    assert q4 == src.parent / f"{src.stem}-to-q4_K_M.gguf" and q4.parent == tmp_path / "llamacpp"
    assert gg.quantized_gguf_path(src, "q8_0") != gg.gguf_path(tmp_path, BUNDLED_EE_DIR, "q8_0")  # not the converter's
    other = gg.quantized_gguf_path(gg.gguf_path(tmp_path, BUNDLED_DIR, "f32"), "q4_K_M")
    assert other != q4  # other weights, other file
    with pytest.raises(ConfigError):
        gg.quantized_gguf_path(src, "q2_K")


def test_cached_quantized_gguf_quantizes_once_and_again_when_the_source_is_newer(monkeypatch, tmp_path):
    src = tmp_path / "llamacpp" / "abc-llama-cpp-python-9.9.9-f32.gguf"
    src.parent.mkdir()
    src.write_bytes(b"f32")
    calls = []

    def fake_quantize(s, out, qtype, threads=0):
        calls.append((Path(s), Path(out), qtype))
        Path(out).write_bytes(b"q")
        return Path(out)

    monkeypatch.setattr(gg, "cached_gguf", lambda run_dir, model_dir, outtype="f32": src)
    monkeypatch.setattr(gg, "quantize_gguf", fake_quantize)
    first = gg.cached_quantized_gguf(tmp_path, "model", "q4_0")
    assert first == src.parent / "abc-llama-cpp-python-9.9.9-f32-to-q4_0.gguf" and len(calls) == 1
    assert gg.cached_quantized_gguf(tmp_path, "model", "q4_0") == first and len(calls) == 1  # cached
    newer = first.stat().st_mtime + 10
    os.utime(src, (newer, newer))  # the f32 file was rebuilt after the quantized one
    assert gg.cached_quantized_gguf(tmp_path, "model", "q4_0") == first and len(calls) == 2
    assert calls[-1] == (src, first, "q4_0")


def test_quantize_refuses_bad_arguments_before_calling_llamacpp(monkeypatch, tmp_path):
    monkeypatch.setattr(gg, "require_available", lambda: pytest.fail("must refuse before needing llama.cpp"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="q4_K_M"):
        gg.quantize_gguf(src, tmp_path / "o.gguf", "q5_K")
    with pytest.raises(SmartExitError, match="missing.gguf does not exist"):
        gg.quantize_gguf(tmp_path / "missing.gguf", tmp_path / "o.gguf", "q8_0")
    with pytest.raises(SmartExitError, match="must name a .gguf file"):
        gg.quantize_gguf(src, tmp_path / "out", "q8_0")
    with pytest.raises(SmartExitError, match="onto itself"):
        gg.quantize_gguf(src, src, "q8_0")


def test_gguf_file_helpers_name_a_missing_file(tmp_path):
    for fn in (gg.gguf_bytes, gg.gguf_tensor_types):
        with pytest.raises(SmartExitError, match="nothing.gguf does not exist"):
            fn(tmp_path / "nothing.gguf")


def test_tensor_type_counts_most_frequent_first():
    types = {"a": "F32", "b": "Q4_0", "c": "Q4_0", "d": "Q6_K", "e": "F32", "f": "Q4_0"}
    assert list(gg.tensor_type_counts(types).items()) == [("Q4_0", 3), ("F32", 2), ("Q6_K", 1)]


def test_next_token_scores_against_a_hand_computed_log_softmax():
    logits = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, -1.0], [1.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=np.float32)
    ids = np.array([7, 2, 0, 1])  # ids[0] is only context
    nll, hit = lq.next_token_scores(logits, ids)
    want = [math.log(1 + math.e + math.e ** 2) - 2.0,  # row 0 predicts 2
            math.log(2 * math.e ** 5 + math.e ** -1) - 5.0,  # row 1 predicts 0
            math.log(math.e + 2) - 0.0]  # row 2 predicts 1
    assert nll.dtype == np.float64 and nll == pytest.approx(want, rel=1e-12)
    assert hit.tolist() == [True, True, False]  # a tie goes to the first maximum, like argmax


def test_next_token_scores_are_stable_for_large_logits():
    logits = np.array([[1e4, 0.0], [0.0, 0.0]])
    nll, _ = lq.next_token_scores(logits, np.array([0, 1]))
    assert np.isfinite(nll).all() and nll[0] == pytest.approx(1e4)
    with pytest.raises(SmartExitError, match="do not fit"):
        lq.next_token_scores(logits, np.array([0, 1, 1]))


def test_peer_quality_summarises_token_scores():
    nll = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    hit = np.array([[True, False, False], [True, True, False]])
    q = lq.PeerQuality.from_scores(nll, hit)
    assert (q.windows, q.window_tokens, q.mean_nll, q.top1, q.window_nll) == (2, 4, 1.0, 0.5, (2.0, 0.0))
    assert q.perplexity == pytest.approx(math.e)
    assert json.loads(json.dumps(q.to_dict()))["window_nll"] == [2.0, 0.0]
    with pytest.raises(SmartExitError, match="same non-empty"):
        lq.PeerQuality.from_scores(nll, hit[:, :2])


class _TablePeer:
    """Logits from a fixed table: row i of a window depends on the token at i only (a bigram model)."""

    def __init__(self, table):
        self.table, self.seen = table, []

    def logits(self, ids):
        self.seen.append(list(ids))
        return self.table[ids]


def test_peer_perplexity_scores_every_window_from_its_own_logits():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(11, 11)).astype(np.float32)
    windows = rng.integers(0, 11, (3, 6))
    peer = _TablePeer(table)
    q = lq.peer_perplexity(peer, windows)
    assert peer.seen == windows.tolist()
    logp = table.astype(np.float64) - np.log(np.exp(table.astype(np.float64)).sum(1, keepdims=True))
    want = -logp[windows[:, :-1], windows[:, 1:]]  # [3, 5]
    assert q.mean_nll == pytest.approx(want.mean(), rel=1e-12) and q.window_nll == pytest.approx(want.mean(1))
    assert q.top1 == pytest.approx((table[windows[:, :-1]].argmax(-1) == windows[:, 1:]).mean())


@pytest.mark.parametrize("bad", [np.zeros((0, 4), np.int64), np.zeros((2, 1), np.int64), np.zeros(4, np.int64),
                                 np.zeros((2, 4), np.float32)])
def test_peer_perplexity_wants_integer_windows_of_two_tokens_or_more(bad):
    with pytest.raises(SmartExitError, match="windows_ids"):
        lq.peer_perplexity(_TablePeer(np.zeros((4, 4))), bad)


# ------------------------------------------------------------------ llama.cpp itself (after `make llamacpp`)
# hidden 256 so that the attention and gate/up rows (256 inputs) take the k-quants' 256-blocks, and an
# intermediate size of 96 so that ffn_down's rows (96 inputs) do not: llama.cpp falls back for those.
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, initializer_range=0.2)
QUANTS = ("q8_0", "q4_0", "q4_K_M")
WINDOWS, LENGTH = 8, 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with its own GPT-2 byte-level tokenizer, its f32 GGUF, the three quantized
    GGUFs, and held-out windows of test-split text. Built once (~20 s: the checkpoint and the converter
    subprocess, which imports torch and transformers), hence the tests that use it are marked slow."""
    if REASON is not None:
        pytest.skip(REASON)
    from edge.core.data import Split, TokenCorpus, load_split
    from edge.model.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("quant")
    tok = train_tokenizer([d.text for d in load_split(Split.CALIBRATION)[:20]], vocab_size=400)
    model = make_hf_checkpoint(root / "model", "llama", vocab_size=tok.get_vocab_size(), **TINY)
    tok.save(str(model / "tokenizer.json"))
    f32 = gg.cached_gguf(root / "run", model, "f32")
    ggufs = {"f32": f32, **{q: gg.cached_quantized_gguf(root / "run", model, q, threads=1) for q in QUANTS}}
    windows = TokenCorpus(tok, load_split(Split.TEST)[:30]).draw(WINDOWS, LENGTH, seed=0).ids
    return model, ggufs, windows


@pytest.fixture(scope="module")
def quality(tiny):
    _, ggufs, windows = tiny
    return {name: lq.peer_perplexity(path, windows, threads=1) for name, path in ggufs.items()}


def _weights(types: dict[str, str], part: str) -> dict[str, str]:
    return {n: t for n, t in types.items() if part in n and n.endswith(".weight")}


@needs_llamacpp
@pytest.mark.slow
def test_quantized_files_store_the_requested_types_and_shrink(tiny):
    _, ggufs, _ = tiny
    types = {name: gg.gguf_tensor_types(p) for name, p in ggufs.items()}
    assert set(types["f32"].values()) == {"F32"}
    assert all(t.keys() == types["f32"].keys() for t in types.values())  # the same tensors, other types
    for q, want in (("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            assert set(_weights(types[q], part).values()) == {want}, (q, part)
        assert set(_weights(types[q], "norm").values()) == {"F32"}  # 1-d tensors are never quantized
    sizes = {name: gg.gguf_bytes(p) for name, p in ggufs.items()}
    assert sizes["f32"] > 3 * sizes["q8_0"] and sizes["q8_0"] > sizes["q4_0"]
    assert sizes == {name: p.stat().st_size for name, p in ggufs.items()}


@needs_llamacpp
@pytest.mark.slow
def test_k_quants_fall_back_where_rows_are_not_256_multiples(tiny):
    """llama-quant.cpp tensor_type_fallback: Q4_K -> Q5_0 and Q6_K -> Q8_0 for rows of 96."""
    types = gg.gguf_tensor_types(tiny[1]["q4_K_M"])
    for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):  # rows of 256
        assert set(_weights(types, part).values()) <= {"Q4_K", "Q6_K"} and "Q4_K" in types.values(), part
    assert set(_weights(types, "ffn_down").values()) <= {"Q5_0", "Q8_0"}


@needs_llamacpp
@pytest.mark.slow
def test_quantized_file_is_cached_beside_the_f32_one(tiny):
    _, ggufs, _ = tiny
    for q in QUANTS:
        assert ggufs[q] == gg.quantized_gguf_path(ggufs["f32"], q) and ggufs[q].is_file()
    assert not [p for p in ggufs["f32"].parent.iterdir() if p.name.startswith(".")]  # no half-written files


@needs_llamacpp
@pytest.mark.slow
def test_f32_peer_perplexity_matches_our_decoder(tiny, quality):
    """The f32 GGUF runs our weights in float32 but keeps K/V in float16 (llama.cpp's default cache
    type): relative error ~2^-11 per cached value, far below the 1e-3 allowed on the mean NLL."""
    import torch

    from edge.model.checkpoint import load_decoder

    model, _, windows = tiny
    with torch.no_grad():
        logits = load_decoder(model)(torch.from_numpy(windows)).logits.numpy()  # [N, T, V]
    scores = [lq.next_token_scores(z, w) for z, w in zip(logits, windows)]
    ours = lq.PeerQuality.from_scores(np.stack([s[0] for s in scores]), np.stack([s[1] for s in scores]))
    peer = quality["f32"]
    assert (peer.windows, peer.window_tokens) == (WINDOWS, LENGTH)
    assert peer.mean_nll == pytest.approx(ours.mean_nll, rel=1e-3)
    assert peer.window_nll == pytest.approx(ours.window_nll, rel=1e-3)
    assert abs(peer.top1 - ours.top1) <= 2 / (WINDOWS * (LENGTH - 1))  # a near-tie may flip


@needs_llamacpp
@pytest.mark.slow
def test_quantized_peers_lose_quality_in_bit_order(quality):
    """INT8 (Q8_0, 8.5 bits a weight) stays within 2% of f32's NLL; INT4 (Q4_0) moves further."""
    f32 = np.array(quality["f32"].window_nll)
    dev = {q: float(np.abs(np.array(quality[q].window_nll) - f32).mean()) for q in QUANTS}
    assert abs(quality["q8_0"].mean_nll / quality["f32"].mean_nll - 1) < 0.02
    assert dev["q4_0"] > dev["q8_0"] and dev["q4_K_M"] > dev["q8_0"]
    assert all(math.isfinite(q.perplexity) and 0 <= q.top1 <= 1 for q in quality.values())


@needs_llamacpp
@pytest.mark.slow
def test_logits_agree_with_greedy_decoding(tiny):
    """The all-positions batch gives the logits that the one-token-at-a-time loop samples from."""
    _, ggufs, windows = tiny
    prompt = windows[0, :8].tolist()
    with lp.LlamaCppPeer(ggufs["q4_0"], threads=1, n_ctx=64) as peer:
        toks = peer.generate(prompt, 4).tokens
        z = peer.logits(prompt + toks[:3])  # [11, V]
        assert z.shape == (11, peer.vocab_size) and z.dtype == np.float32
        assert z[7:].argmax(-1).tolist() == toks
        with pytest.raises(SmartExitError, match="token ids"):
            peer.logits([0, peer.vocab_size])
        with pytest.raises(SmartExitError, match="n_ctx"):
            peer.logits([0] * 65)


@needs_llamacpp
def test_quantizer_failure_names_the_file_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(gg.QuantizationFailed, match=r"bad\.gguf to q4_K_M.*\n.*GGUF"):
        gg.quantize_gguf(bad, tmp_path / "out" / "bad-q4.gguf", "q4_K")
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(SmartExitError, match="not a readable GGUF"):
        gg.gguf_tensor_types(bad)
