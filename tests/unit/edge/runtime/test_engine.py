"""The engine against the reference generator, batching invariance, KV modes, control surface."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge.model.config import ModelConfig
from edge.runtime.backend import make_backend
from edge.runtime.backend_host import build_mask
from edge.runtime.torch_backend import TorchBackend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import NO_TOKEN, Request, TokenEvent
from edge.runtime.rules import ConfidenceRule
from edge.runtime.sampling import choose_token
from edge.core.errors import ConfigError, SmartExitError
from edge.model.exits import ExitConfig, MultiExitModel, exit_decision_stats
from edge.model.reference import reference_generate
from edge.model.decoder import Decoder, attention_mask
from tests.tolerance import assert_f32_close

CFG = ModelConfig(vocab_size=300, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                  intermediate_size=96, max_position_embeddings=128)


def _model(seed=0, gate_hidden=0, **overrides) -> MultiExitModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**CFG.to_dict(), **overrides})
    dec = Decoder(cfg)
    dec.init_weights(seed, std=0.3)
    m = MultiExitModel(dec.eval(), ExitConfig(layers=[2, 4, 6], adapter_rank=4, gate_hidden=gate_hidden)).eval()
    with torch.no_grad():
        for p in m.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    return m


def _prompts(n, seed=0, lo=3, hi=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _run(engine, prompts, max_tokens=12, **kw):
    out = {}
    ids = [engine.submit(Request(p, max_tokens, **kw)) for p in prompts]
    events = []
    while engine.has_work:
        events += engine.step()
    for e in events:
        out.setdefault(e.request_id, []).append((e.token, e.exit_layer))
    return [out[i] for i in ids]


def test_build_mask_matches_model_mask():
    q = np.array([[5, 6], [2, 3]])
    past = np.array([5, 2])
    got = build_mask(q, past, 5, window=None)
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 2, 3]])
    k_valid = torch.tensor([[True] * 7, [True, True, False, False, False, True, True]])
    ref = attention_mask(torch.from_numpy(q), k_pos, k_valid)
    assert np.array_equal(got, ref.numpy())


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_engine_matches_reference_generator_one_at_a_time(threshold):
    m = _model()
    rule = ConfidenceRule(threshold) if threshold else None
    for p in _prompts(3):
        eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128), rule=rule)
        got = _run(eng, [p])[0]
        ref = reference_generate(m, p, 12, rule=rule)
        assert [t for t, _ in got] == ref.tokens
        assert [e for _, e in got] == ref.exit_layers
    if threshold:
        assert any(e < 6 for e in ref.exit_layers), "threshold should make some tokens exit early"


@pytest.mark.parametrize("mode", list(KVMode))
def test_batched_equals_sequential(mode):
    m = _model(seed=1)
    prompts = _prompts(5, seed=1)
    # rows exit at every batch size (deferral's limit lifted): batching must not change a row's tokens
    cfg = dict(max_len=128, kv_mode=mode, prefill_budget=16, defer_exit_max_batch=None)
    seq = [_run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, **cfg), ConfidenceRule(0.3)), [p])[0]
           for p in prompts]
    batched = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, **cfg), ConfidenceRule(0.3)),
                   prompts)
    assert batched == seq


@torch.no_grad()
def _defer_reference(m, prompt, n, rule):
    """Greedy early exit where a token that stops at layer e still runs layers e+1.. for their keys /
    values at once. Defer mode runs them later, with the next token that reaches them; attention is
    causal, so the two agree. Returns (tokens, exit layers, keys, values) with K/V per layer [KV, P, hd]."""
    bb = m.backbone
    out = bb(torch.tensor([prompt]))
    keys, values = list(out.keys), list(out.values)
    tokens, exits = [int(out.logits[0, -1].argmax())], [m.num_layers]
    for pos in range(len(prompt), len(prompt) + n - 1):
        positions = torch.tensor([[pos]])
        cos, sin = bb.rope(positions)
        mask = attention_mask(positions, torch.arange(pos + 1)[None])
        h, decided, stats, argmax = bb.embed(torch.tensor([[tokens[-1]]])), None, {}, {}
        for j in range(m.num_layers):
            h, k, v = bb.layers[j](h, cos, sin, keys[j], values[j], mask)
            keys[j], values[j] = torch.cat((keys[j], k), 2), torch.cat((values[j], v), 2)
            layer = j + 1
            if decided is None and layer in m.exit_layers:
                logits = m.exit_logits(layer, h)[:, -1]  # [1, V]
                st, tk = exit_decision_stats(logits)
                stats[layer], argmax[layer] = st.numpy(), tk.numpy()
                if layer == m.num_layers or rule.decide(layer, stats, argmax, {})[0]:
                    decided = (int(tk[0]), layer)
        tokens.append(decided[0])
        exits.append(decided[1])
    return tokens, exits, [k[0].numpy() for k in keys], [v[0].numpy() for v in values]


def _filled(prompt_len, exits, num_layers):
    """[L, P] mask of the cache entries defer mode must have written when generation ends: the input
    of decode step k (position prompt_len + k - 1) stopped at exits[k]; its skipped layers are filled
    only once a later input runs them."""
    fed = exits[1:]
    mask = np.ones((num_layers, prompt_len + len(fed)), bool)
    for k, e in enumerate(fed):
        for j in range(num_layers):  # 0-based layer j ran for an input that stopped at e > j
            mask[j, prompt_len + k] = any(later > j for later in fed[k:])
    return mask


@pytest.mark.parametrize("batch", [1, 2], ids=["one_call", "catch_up"])
def test_defer_mode_with_exits_matches_recomputation_reference(batch):
    """Defer mode, exits on: tokens, exit layers and every cache entry it had to write equal a
    reference that runs the skipped layers of each exited token at once. Batch 1 runs the deferred
    rows in the new token's call, batch 2 in separate catch-up calls."""
    m = _model(seed=2)
    prompts = _prompts(batch, seed=2)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=batch, max_running=batch, max_len=128,
                                               kv_mode=KVMode.DEFER, defer_exit_max_batch=None), ConfidenceRule(0.3))
    got = _run(eng, prompts, max_tokens=16)
    for slot, (p, seq) in enumerate(zip(prompts, got)):
        tokens, exits, keys, values = _defer_reference(m, p, 16, ConfidenceRule(0.3))
        assert [t for t, _ in seq] == tokens and [e for _, e in seq] == exits
        filled = _filled(len(p), exits, CFG.num_layers)
        # entries skipped by their own token and written later, when a following token ran the layer
        late = [(j, k) for k, e in enumerate(exits[1:]) for j in range(e, CFG.num_layers) if filled[j, len(p) + k]]
        assert late, "the test needs deferred rows that were run"
        for j in range(CFG.num_layers):
            cols = np.flatnonzero(filled[j])
            # batched / gathered vs one token at a time: summation order only, through up to 6 layers
            assert_f32_close(eng.cache.keys[j][slot][:, cols], keys[j][:, cols], CFG.hidden_size, CFG.num_layers,
                             f"keys layer {j}")
            assert_f32_close(eng.cache.values[j][slot][:, cols], values[j][:, cols], CFG.hidden_size,
                             CFG.num_layers, f"values layer {j}")
        assert any(a < CFG.num_layers and b < CFG.num_layers for a, b in zip(exits[1:], exits[2:])), \
            "the test needs two early exits in a row: several deferred rows run together"


class _ExitOnceAt2:
    """Exit at layer 2 on the first decode step only."""

    def __init__(self):
        self.calls = 0

    def decide(self, layer, stats, tokens, hidden):
        self.calls += layer == 2
        return np.full(tokens[layer].shape[0], layer == 2 and self.calls == 1)


@pytest.mark.parametrize("mode", list(KVMode))
def test_skipped_layer_kv_is_filled_as_specified(mode):
    """Token at position n exits after layer 2; the next token runs full depth. The cache of layers
    3..6 at position n must hold: (propagate) K/V projections of the exit residual; (defer) K/V of
    those layers actually run on the exit residual, attending to the cached past."""
    m = _model(seed=3)
    bb = m.backbone
    prompt = _prompts(1, seed=3)[0]
    n = len(prompt)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128, kv_mode=mode), _ExitOnceAt2())
    out = _run(eng, [prompt], max_tokens=3)[0]
    assert [e for _, e in out] == [6, 2, 6]
    with torch.no_grad():
        full = bb(torch.tensor([prompt + [out[0][0]]]))
        h = full.hidden_states[2][:, n:n + 1]  # exit residual of position n (its past is exact)
        cos, sin = bb.rope(torch.tensor([[n]]))
        mask = attention_mask(torch.tensor([[n]]), torch.arange(n + 1)[None])
        for j in range(2, 6):
            if mode is KVMode.PROPAGATE:
                k, v = bb.layers[j].kv_only(h, cos, sin)
            else:
                pk = torch.from_numpy(eng.cache.keys[j][:1, :, :n].copy())
                pv = torch.from_numpy(eng.cache.values[j][:1, :, :n].copy())
                h, k, v = bb.layers[j](h, cos, sin, pk, pv, mask)
            # the engine's path (batched, masked, past gathered from the cache) and this one differ in
            # summation order only: hidden-size dot products through up to 4 layers
            depth = 1 if mode is KVMode.PROPAGATE else j - 1
            assert_f32_close(eng.cache.keys[j][0, :, n], k[0, :, 0].numpy(), CFG.hidden_size, depth, f"key {j}")
            assert_f32_close(eng.cache.values[j][0, :, n], v[0, :, 0].numpy(), CFG.hidden_size, depth, f"value {j}")


def test_prefill_budget_chunks_and_admission_queue():
    m = _model(seed=4)
    prompts = _prompts(4, seed=4, lo=30, hi=40)
    ref = [_run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128)), [p])[0] for p in prompts]
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=2, max_len=128, prefill_budget=7, max_running=2))
    ids = [eng.submit(Request(p, 12)) for p in prompts]
    eng.step()
    st = eng.stats()
    assert st.waiting == 2 and st.running == 2  # more requests than slots: queued, not crashed
    assert st.prefill_backlog_tokens == sum(len(p) for p in prompts) - 7
    events = []
    while eng.has_work:
        events += eng.step()
    got = {i: [(e.token, e.exit_layer) for e in events if e.request_id == i] for i in ids}
    assert [got[i] for i in ids] == ref


def test_streaming_callback_cancel_and_control():
    m = _model(seed=5)
    seen = []
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=2, max_len=128))
    a = eng.submit(Request([1, 2, 3], 50, on_token=seen.append))
    b = eng.submit(Request([4, 5, 6], 5))
    for _ in range(4):
        eng.step()
    assert [e.index for e in seen] == list(range(len(seen))) and len(seen) >= 3
    assert eng.cancel(a) and not eng.cancel(a)
    assert eng.cache.free_slots == 1
    eng.set_prefill_budget(3)
    eng.set_admission_limit(1)
    assert eng.stats().prefill_budget == 3 and eng.stats().max_running == 1
    with pytest.raises(ConfigError):
        eng.set_prefill_budget(0)
    eng.run_until_idle()
    assert not eng.has_work and eng.cache.free_slots == 2 and b not in eng.stats().deadlines


def _tokens(events, rid):
    return [e.token for e in events if e.request_id == rid and e.token != NO_TOKEN]


def _cancelled_event(ev, rid, index):
    return (ev.request_id, ev.token, ev.exit_layer, ev.index, ev.finished, ev.finish_reason) == (
        rid, NO_TOKEN, NO_TOKEN, index, True, "cancelled")


def test_cancel_from_callbacks_own_and_other_requests():
    """Callbacks cancel: a request whose token comes later in the same step (B: that token is
    dropped), one whose token came earlier (A), themselves (C), themselves on their last token (D:
    nothing left to cancel). The step goes on; the others' tokens are what they are uncancelled."""
    m = _model(seed=5)
    prompts = _prompts(4, seed=5)
    cfg = EngineConfig(max_seqs=4, max_running=4, max_len=128)
    full = _run(Engine(TorchBackend(m), cfg), prompts, max_tokens=12)
    eng = Engine(TorchBackend(m), cfg)
    seen, results, ids = [], [], {}

    def callback(name, plan):
        def on_token(ev):
            seen.append(ev)
            if ev.token != NO_TOKEN and ev.index in plan:
                results.append((name, eng.cancel(ids[plan[ev.index]])))
        return on_token

    plans = {"A": {2: "B"}, "B": {}, "C": {4: "A", 6: "C"}, "D": {9: "D"}}  # at its token index: cancel
    for (name, plan), p in zip(plans.items(), prompts):  # slots 0..3: tokens are emitted in this order
        ids[name] = eng.submit(Request(p, 10 if name == "D" else 12, on_token=callback(name, plan)))
    events = []
    while eng.has_work:
        events += eng.step()
    assert events == seen  # step() returns what the callbacks saw, in the same order
    assert results == [("A", True), ("C", True), ("C", True), ("D", False)]
    a, b, c, d = (ids[k] for k in "ABCD")
    assert _tokens(events, b) == [t for t, _ in full[1][:2]]  # its token of A's index-2 step is dropped
    assert _cancelled_event([e for e in events if e.request_id == b][-1], b, 2)
    assert _tokens(events, a) == [t for t, _ in full[0][:5]]  # its index-4 token came before C's cancel
    assert _cancelled_event([e for e in events if e.request_id == a][-1], a, 5)
    assert _tokens(events, c) == [t for t, _ in full[2][:7]]
    assert _cancelled_event([e for e in events if e.request_id == c][-1], c, 7)
    d_events = [e for e in events if e.request_id == d]
    assert _tokens(events, d) == [t for t, _ in full[3][:10]] and [e.finish_reason for e in d_events][-2:] == [None, "length"]
    assert not eng.has_work and eng.cache.free_slots == 4 and not eng.cancel(c)


def test_cancel_in_prefill():
    """A request cancelled half-prefilled frees its slot, and the next request in that slot is not
    affected by its keys / values; one cancelled by a callback in the same prefill pass is skipped."""
    m = _model(seed=8)
    long, short, other = _prompts(3, seed=8, lo=30, hi=40)
    alone = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128)), [other], max_tokens=6)[0]
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128, prefill_budget=7))
    first = eng.submit(Request(long, 6))
    assert eng.step() == [] and eng.stats().prefill_backlog_tokens == len(long) - 7
    assert eng.cancel(first) and eng.cache.free_slots == 1 and eng.stats().running == 0
    assert _cancelled_event(eng.step()[0], first, 0)
    assert _run(eng, [other], max_tokens=6)[0] == alone

    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=2, max_len=128, prefill_budget=64))
    later = []
    eng.submit(Request(short[:3], 6, on_token=lambda ev: ev.index == 0 and eng.cancel(later[0])))
    later.append(eng.submit(Request(long, 6)))  # prefilled after the first in the same step
    events = eng.step()
    assert [(e.request_id, e.finish_reason) for e in events][-1] == (later[0], "cancelled")
    assert eng.stats().running == 1 and eng.cache.free_slots == 1


def test_deadline_ends_requests_and_frees_their_slots():
    """Deadlines on the engine's clock: a waiting request past it never gets a slot, a decoding one
    is ended with its tokens so far, and the slot goes to the next request in the same step."""
    m = _model(seed=9)
    pa, pb, pc = _prompts(3, seed=9)
    alone = [_run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128)), [p], max_tokens=8)[0]
             for p in (pa, pc)]
    now = [0.0]
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128), clock=lambda: now[0])
    seen = []
    a = eng.submit(Request(pa, 8, deadline=10.0, on_token=seen.append))
    b = eng.submit(Request(pb, 8, deadline=5.0, on_token=seen.append))
    c = eng.submit(Request(pc, 8))
    events = eng.step() + eng.step() + eng.step()
    assert eng.stats().deadlines == {a: 10.0, b: 5.0, c: None}
    now[0] = 5.0
    events += eng.step()
    assert [e for e in seen if e.request_id == b] == [TokenEvent(b, NO_TOKEN, NO_TOKEN, 0, True, "deadline")]
    assert b not in eng.stats().deadlines
    now[0] = 10.0
    ended = eng.step()
    assert ended[0] == TokenEvent(a, NO_TOKEN, NO_TOKEN, 4, True, "deadline")
    assert eng.stats().running == 1  # c took the freed slot in the same step
    events += ended
    while eng.has_work:
        events += eng.step()
    assert _tokens(events, a) == [t for t, _ in alone[0][:4]]
    assert _tokens(events, c) == [t for t, _ in alone[1]] and _tokens(events, b) == []
    assert eng.cache.free_slots == 1


def test_one_finish_event_when_a_deadline_callback_cancels_another_request():
    eng = Engine(TorchBackend(_model()), EngineConfig(max_seqs=1, max_len=128), clock=lambda: 1.0)
    seen, ids = [], []
    ids.append(eng.submit(Request([1, 2], 4, deadline=1.0, on_token=lambda ev: seen.append(ev) or eng.cancel(ids[1]))))
    ids.append(eng.submit(Request([3, 4], 4, deadline=1.0, on_token=seen.append)))
    assert [(e.request_id, e.finish_reason) for e in eng.step()] == [(ids[0], "deadline"), (ids[1], "cancelled")]
    assert len(seen) == 2 and not eng.has_work and eng.cache.free_slots == 1


def test_stop_token_ends_the_request():
    m = _model(seed=6)
    p = [7, 8, 9]
    first = _run(Engine(TorchBackend(m), EngineConfig(max_len=128)), [p])[0][0][0]
    eng = Engine(TorchBackend(m), EngineConfig(max_len=128))
    eng.submit(Request(p, 12, stop_ids=(first,)))
    events = eng.step()
    assert [(e.token, e.finished, e.finish_reason) for e in events] == [(first, True, "stop")]
    assert not eng.has_work and eng.cache.free_slots == eng.cfg.max_seqs


@torch.no_grad()
def _sample_reference(m, prompt, n, temperature, top_p, seed):
    """Full-depth sampling, one forward over the whole sequence per token, a generator per request."""
    rng = np.random.default_rng(seed)
    ids = list(prompt)
    for _ in range(n):
        logits = m.backbone(torch.tensor([ids])).logits[0, -1].numpy()
        ids.append(choose_token(logits, temperature, top_p, rng))
    return ids[len(prompt):]


def test_each_request_samples_with_its_own_settings_and_seed():
    """Requests batched together each sample from the full model's logits with their own
    temperature, top-p and generator (the sampler itself is tested in test_sampling.py)."""
    m = _model(seed=6)
    prompts = _prompts(3, seed=6)
    settings = [dict(temperature=1.0, top_p=0.9, seed=3), dict(temperature=0.7, top_p=1.0, seed=4),
                dict(temperature=1.5, top_p=0.8, seed=3)]
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=128))
    ids = [eng.submit(Request(p, 8, **kw)) for p, kw in zip(prompts, settings)]
    events = []
    while eng.has_work:
        events += eng.step()
    for i, p, kw in zip(ids, prompts, settings):
        got = _tokens(events, i)
        assert got == _sample_reference(m, p, 8, kw["temperature"], kw["top_p"], kw["seed"])
        assert got != reference_generate(m, p, 8).tokens, "sampling should leave the greedy path"


@pytest.mark.parametrize("req,msg", [
    (Request([], 4), "empty prompt"),
    (Request([1] * 120, 16), "exceeds the context window"),
    (Request([1, 999], 4), "outside the vocabulary"),
])
def test_bad_requests(req, msg):
    eng = Engine(TorchBackend(_model()), EngineConfig(max_len=128))
    with pytest.raises(SmartExitError, match=msg):
        eng.submit(req)


def test_unknown_backend():
    with pytest.raises(ConfigError, match="unknown backend"):
        make_backend("tpu", model=_model())


def test_segment_call_shapes_are_checked():
    """A call holds one row per sequence or one sequence; segment 0 takes ids, later ones hidden."""
    eng = Engine(TorchBackend(_model()), EngineConfig(max_seqs=2, max_len=32))
    b = eng.backend
    with pytest.raises(ConfigError, match="one row per sequence or one sequence"):
        b.segment(0, np.zeros((2, 3), np.int64), np.arange(2), np.zeros(2, np.int64))
    with pytest.raises(ConfigError, match="token ids"):
        b.segment(1, np.zeros((1, 1), np.int64), np.arange(1), np.zeros(1, np.int64))
    with pytest.raises(ConfigError, match="capacity"):
        b.segment(0, np.zeros((1, 4), np.int64), np.arange(1), np.array([30]))


def test_max_len_beyond_model_positions_refused():
    with pytest.raises(ConfigError, match="positions"):
        Engine(TorchBackend(_model()), EngineConfig(max_len=CFG.max_position_embeddings + 1))


def test_slots_are_handed_out_lowest_first():
    from edge.runtime.cache import KVCache, contiguous_start

    c = KVCache(1, 1, 2, 4, 8)
    assert [c.alloc() for _ in range(3)] == [0, 1, 2]
    c.release(1)
    assert c.alloc() == 1
    assert contiguous_start(np.array([1, 2, 3])) == 1 and contiguous_start(np.array([0, 2])) is None
    assert contiguous_start(np.array([3])) == 3


def test_sliding_window_model():
    m = _model(seed=7, sliding_window=8)
    p = _prompts(1, seed=7, lo=15, hi=16)[0]
    got = _run(Engine(TorchBackend(m), EngineConfig(max_len=128, prefill_budget=5)), [p])[0]
    assert [t for t, _ in got] == reference_generate(m, p, 12).tokens


@pytest.mark.parametrize("limit", [1, None])
def test_deferral_exits_only_up_to_the_batch_limit(limit):
    """With deferral rows exit only while the decode batch has at most ``defer_exit_max_batch`` sequences:
    above it every row runs to full depth (exact K/V, the full model's tokens); at batch 1 they exit."""
    m, prompts = _model(), _prompts(3, seed=21)
    rule = ConfidenceRule(0.0)  # exit at the first exit whenever allowed
    cfg = dict(max_len=128, kv_mode=KVMode.DEFER, defer_exit_max_batch=limit)
    batched = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, **cfg), rule), prompts)
    full = [_run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128)), [p])[0] for p in prompts]
    alone = [_run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, **cfg), rule), [p])[0] for p in prompts]
    first, last = m.exit_layers[0], m.exit_layers[-1]
    assert all(e == first for seq in alone for _, e in seq[1:])  # batch 1: every decoded token exits
    if limit is None:
        assert batched == alone  # deferral is exact: a row's tokens do not depend on its batch
    else:
        # while all three sequences decode together nothing exits; the tokens are the full model's
        assert all(e == last for seq in batched for _, e in seq)
        assert batched == full
    with pytest.raises(ConfigError, match="defer_exit_max_batch"):
        EngineConfig(defer_exit_max_batch=0)


def test_request_modes_full_never_exits_and_unknown_modes_are_refused():
    """A request in mode full gets the full model's tokens from a batch whose other rows exit; mode
    exact with exit drafts only and the calibrated draft-length rule is refused, clearly, by an engine
    whose rule has no calibrators (with lookup drafts, the default, it is served); unknown modes too."""
    from edge.runtime.request import Mode
    from edge.runtime.speculative import SpecConfig

    m, prompts = _model(), _prompts(2, seed=31)
    cfg = EngineConfig(max_seqs=2, max_running=2, max_len=128, kv_mode=KVMode.PROPAGATE)
    eng = Engine(TorchBackend(m), cfg, ConfidenceRule(0.0))  # exit at the first exit whenever allowed
    ids = [eng.submit(Request(prompts[0], 8, mode=Mode.FULL)), eng.submit(Request(prompts[1], 8, mode="bounded"))]
    got: dict[int, list] = {}
    while eng.has_work:
        for ev in eng.step():
            got.setdefault(ev.request_id, []).append((ev.token, ev.exit_layer))
    full = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128)), [prompts[0]], max_tokens=8)[0]
    assert got[ids[0]] == full
    assert all(e == m.exit_layers[0] for _, e in got[ids[1]][1:])  # the bounded row exits
    eng.check(Request(prompts[0], 4, mode="exact"))  # lookup drafts need no calibrators
    exit_only = Engine(TorchBackend(m), EngineConfig(max_len=128, speculative=SpecConfig(sources=("exit",))),
                       ConfidenceRule(0.0))
    with pytest.raises(SmartExitError, match="needs the threshold table's calibrators"):
        exit_only.submit(Request(prompts[0], 4, mode="exact"))
    with pytest.raises(SmartExitError, match="not one of bounded, full, exact"):
        eng.submit(Request(prompts[0], 4, mode="fast"))


def test_a_new_engine_takes_over_an_idle_cache_of_its_shape():
    """An engine per request (the benchmarks', ``generate``'s) reuses the backend's idle cache and its
    bindings; a busy cache or another shape gets a cache of its own; outputs are unchanged."""
    m, prompts = _model(), _prompts(3, seed=5)
    backend = TorchBackend(m)
    cfg = EngineConfig(max_seqs=2, max_running=2, max_len=64)
    first = Engine(backend, cfg)
    a = _run(first, prompts[:2], max_tokens=6)
    second = Engine(backend, cfg)
    assert second.cache is first.cache  # idle: every slot free
    assert _run(second, prompts[:2], max_tokens=6) == a
    busy = Engine(backend, cfg)
    busy.submit(Request(prompts[2], 4))
    busy.step()  # holds a slot now
    assert Engine(backend, cfg).cache is not busy.cache
    assert Engine(backend, EngineConfig(max_seqs=2, max_running=2, max_len=32)).cache.shape[2] == 32
