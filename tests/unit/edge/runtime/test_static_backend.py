"""The static-cache torch backend (edge/runtime/static_backend.py) on the CPU, eagerly: the engine over it
decodes what the engine over the torch reference decodes (batched, scattered slots, padding rows of a
batch bucket, both K/V modes after exits), its segment outputs agree with the reference's, and it keeps
its cache on its device. CUDA graph capture needs a GPU: tests/gpu/test_static_backend_cuda.py checks
the captured graphs there; here ``graphs=True`` must refuse."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from edge.core.errors import ConfigError
from edge.model.exits import save_multi_exit
from edge.runtime.backend import make_backend
from edge.runtime.cache import KVCache
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.rules import ConfidenceRule
from edge.runtime.static_backend import StaticTorchBackend
from edge.runtime.torch_backend import TorchBackend
from tests.tolerance import assert_f32_close
from tests.unit.edge.runtime.test_engine import CFG, _model, _prompts, _run


@pytest.mark.parametrize("mode", list(KVMode))
def test_engine_over_it_decodes_what_the_reference_decodes(mode):
    """5 prompts through 3 slots: batches of 1-3 rows (3 runs in bucket 4 with one padding row), rows
    that leave in the middle (scattered slots), exits with K/V propagated or deferred."""
    m = _model(seed=1)
    prompts = _prompts(5, seed=2)
    cfg = EngineConfig(max_seqs=3, max_running=3, max_len=128, kv_mode=mode, prefill_budget=16,
                       defer_exit_max_batch=None)
    ref = _run(Engine(TorchBackend(m), cfg, ConfidenceRule(0.3)), prompts)
    backend = StaticTorchBackend(m, device="cpu")
    eng = Engine(backend, cfg, ConfidenceRule(0.3))
    got = _run(eng, prompts)
    assert got == ref
    assert any(e < CFG.num_layers for row in got for _, e in row), "the rule should make some tokens exit"
    assert backend.buckets == [1, 2, 3]  # powers of two up to the slots, and the slots
    assert eng.cache.keys == [], "the engine holds slots only; the K/V live in the backend, on its device"
    assert tuple(backend.keys[0].shape) == (4, CFG.num_kv_heads, 128, CFG.head_dim)  # + the spare slot
    # a second engine of the same shape keeps the device cache (and, on a GPU, its graphs): stale K/V unread
    keys = backend.keys[0]
    assert _run(Engine(backend, cfg, ConfidenceRule(0.3)), prompts) == ref
    assert backend.keys[0] is keys


def test_segment_outputs_agree_with_the_reference():
    """One decode call of 3 rows over scattered slots (bucket 4: a padding row), after a prompt chunk each."""
    m = _model(seed=4)
    backends = [TorchBackend(m), StaticTorchBackend(m, device="cpu", buckets=[1, 4])]
    outs = []
    for be in backends:
        cache = KVCache(be.num_layers, be.num_kv_heads, be.head_dim, 6, 64, allocate=be.host_cache)
        be.attach(cache)
        starts = np.array([5, 9, 2])
        slots = np.array([4, 0, 2])
        for s, n in zip(slots, starts):  # each sequence's prompt, one chunk, full depth
            ids = np.random.default_rng(int(s)).integers(0, 300, (1, int(n)))
            x = ids
            for i in range(len(be.segments)):
                o = be.segment(i, x, np.array([s]), np.zeros(1, np.int64), decide=False)
                x = o.hidden
        x = np.random.default_rng(0).integers(0, 300, (3, 1))
        got = []
        prev = None
        for i in range(len(be.segments)):
            o = be.segment(i, x, slots, starts, prev)
            got.append(o)
            prev, x = o, o.hidden
        outs.append(got)
    for i, (r, s) in enumerate(zip(*outs)):
        depth = len(backends[0].segments[i]) * (i + 1)
        for name in ("exit_hidden", "logits", "stats"):
            assert_f32_close(getattr(s, name), getattr(r, name), CFG.hidden_size, depth, f"segment {i} {name}")
        assert np.array_equal(s.token, r.token)
        if r.hidden is not None:
            assert_f32_close(s.hidden, r.hidden, CFG.hidden_size, depth, f"segment {i} hidden")
            assert_f32_close(s.score, r.score, CFG.hidden_size, depth, f"segment {i} score")


def test_a_checkpoint_loads_by_path(tmp_path):
    m = _model(seed=7)
    save_multi_exit(m, tmp_path / "ckpt", tokenizer=None, metrics={}, source={})
    backend = make_backend("torch_static", checkpoint=str(tmp_path / "ckpt"), device="cpu")
    eng = Engine(backend, EngineConfig(max_seqs=2, max_len=64))
    out = _run(eng, [[1, 2, 3, 4], [5, 6, 7]], max_tokens=4)
    assert [len(r) for r in out] == [4, 4]
    assert all(e == backend.num_layers for r in out for _, e in r)  # no rule: full depth


def test_half_precision_runs_with_a_cache_of_its_dtype():
    """bfloat16 on the CPU: K/V written in the cache's dtype (rotary tables are cast; index_put_ refuses
    mixed dtypes). Tokens may differ from float32 near ties, so only the first one is compared (the
    prefill's argmax, which bfloat16 rounding rarely changes on this random model)."""
    m = _model(seed=6)
    prompts = _prompts(2, seed=6)
    cfg = EngineConfig(max_seqs=2, max_len=64)
    ref = _run(Engine(StaticTorchBackend(_model(seed=6), device="cpu"), cfg), prompts, max_tokens=6)
    backend = StaticTorchBackend(m, device="cpu", dtype="bfloat16")
    got = _run(Engine(backend, cfg), prompts, max_tokens=6)
    assert backend.keys[0].dtype.is_floating_point and str(backend.keys[0].dtype) == "torch.bfloat16"
    assert [r[0] for r in got] == [r[0] for r in ref]


@pytest.mark.parametrize("kw, msg", [
    (dict(graphs=True, device="cpu"), "CUDA graphs need a CUDA device"),
    (dict(dtype="float8"), "dtype 'float8'"),
    (dict(model=None), "needs the model or its checkpoint"),
])
def test_bad_settings_are_refused(kw, msg):
    args = {"model": _model(), **kw}
    with pytest.raises(ConfigError, match=msg):
        StaticTorchBackend(**args)


@pytest.mark.parametrize("mode", list(KVMode))
def test_shortlist_checks_decide_as_the_reference(mode):
    """A shortlist model (its candidate logits computed on the backend's device, the rest of the check on
    the host): the engine over it emits the reference's tokens at the reference's layers, batched, with
    rows leaving at a threshold where some leave and some run to full depth."""
    from tests.unit.edge.runtime.test_candidates import _mixed_threshold, _model as _listed

    m = _listed(seed=2)
    prompts = _prompts(5, seed=8)
    cfg = dict(max_seqs=3, max_running=3, max_len=128, kv_mode=mode, prefill_budget=16, defer_exit_max_batch=None)
    thr = _mixed_threshold(m, prompts, cfg)
    ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(thr)), prompts, max_tokens=16)
    backend = StaticTorchBackend(m, device="cpu")
    got = _run(Engine(backend, EngineConfig(**cfg), ConfidenceRule(thr)), prompts, max_tokens=16)
    assert got == ref
    assert backend._rows_t is not None and tuple(backend._rows_t.shape) == (CFG.hidden_size, m.exit_cfg.shortlist)


def test_residual_and_logits_stay_on_the_device_until_read(monkeypatch):
    """Greedy decode steps never copy a residual or a B x V logits array to the host (the next segment takes
    the residual where it is; a greedy token is the device's argmax): the only logits read are each
    prompt's last row, once per request (the first token). A sampled request reads its logits and gets
    the reference's tokens for the same seed."""
    from edge.runtime.static_capture import OnDevice

    reads = []
    real = OnDevice.host
    monkeypatch.setattr(OnDevice, "host", lambda self: reads.append(self.shape) or real(self))
    m = _model(seed=3)
    prompts = _prompts(3, seed=9)
    cfg = EngineConfig(max_seqs=3, max_running=3, max_len=128, prefill_budget=16)
    ref = _run(Engine(TorchBackend(m), cfg), prompts)
    assert _run(Engine(StaticTorchBackend(m, device="cpu"), cfg), prompts) == ref
    assert reads == [(1, CFG.vocab_size)] * len(prompts), f"greedy decoding copied {reads} to the host"
    reads.clear()
    ref = _run(Engine(TorchBackend(m), cfg), prompts, temperature=0.9, seed=5)
    got = _run(Engine(StaticTorchBackend(m, device="cpu"), cfg), prompts, temperature=0.9, seed=5)
    assert got == ref
    assert len(reads) > len(prompts), "sampled decode steps read their logits"


def test_exact_requests_decode_what_full_ones_do():
    """Mode exact (lookup drafts verified at full depth, speculation forced so that rounds happen) over this
    backend: the greedy tokens of mode full, token for token, batched; drafts were verified and accepted."""
    from edge.runtime.request import Mode
    from tests.unit.edge.runtime.test_lookup_drafts import _engine, _looping, _looping_prompts

    m = copy.deepcopy(_looping())  # greedy continuations loop: lookup drafts are accepted there
    prompts = _looping_prompts(6, seed=10)
    backend = StaticTorchBackend(m, device="cpu")
    full = _run(_engine(backend, max_seqs=3, max_running=3, prefill_budget=16), prompts, max_tokens=32,
                mode=Mode.FULL)
    eng = _engine(backend, max_seqs=3, max_running=3, prefill_budget=16)
    exact = _run(eng, prompts, max_tokens=32, mode=Mode.EXACT)
    assert [[t for t, _ in r] for r in exact] == [[t for t, _ in r] for r in full]
    assert eng.spec_stats.rounds > 0 and eng.spec_stats.accepted > 0, "speculative rounds should have run"


@pytest.mark.parametrize("mode", list(KVMode))
@pytest.mark.parametrize("listed", [False, True], ids=["full_head", "shortlist"])
def test_pipelined_decode_decides_as_the_reference(mode, listed):
    """``pipeline``: each next segment launched before the previous decision is read. Where rows leave, the
    segment launched ahead was computed for nothing (counted) and its K/V rows are written again or
    propagated over: the tokens and exit layers are the reference's, in both K/V modes, batched."""
    from tests.unit.edge.runtime.test_candidates import _mixed_threshold, _model as _listed

    m = _listed(seed=2) if listed else _model(seed=1)
    prompts = _prompts(5, seed=8)
    cfg = dict(max_seqs=3, max_running=3, max_len=128, kv_mode=mode, prefill_budget=16, defer_exit_max_batch=None)
    rule = ConfidenceRule(_mixed_threshold(m, prompts, cfg) if listed else 0.3)
    ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), rule), prompts, max_tokens=16)
    backend = StaticTorchBackend(m, device="cpu", pipeline=True)
    assert _run(Engine(backend, EngineConfig(**cfg), rule), prompts, max_tokens=16) == ref
    assert any(e < m.num_layers for row in ref for _, e in row)
    assert backend.wasted_segments > 0, "rows left at a check with the next segment launched ahead"
