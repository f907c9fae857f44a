"""Mode exact above batch 1: several sequences' lookup drafts verified in one call (``Backend.verify``,
the ``verify_{B}`` graphs of exporters/ort_fused.py, ``Engine._verify_together``)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edge.core.errors import ConfigError
from edge.runtime.backend import make_backend
from edge.runtime.cache import KVCache
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Mode
from edge.runtime.spec_costs import CallCosts
from edge.runtime.spec_gates import SpeculationGate
from edge.runtime.speculative import SpecConfig
from edge.runtime.torch_backend import TorchBackend
from exporters.onnx_config import ExportConfig
from tests.unit.edge.runtime.test_engine import _run
from tests.unit.edge.runtime.test_lookup_drafts import LOOKUP, _AlwaysSpeculate, _FlatCosts, _looping, _looping_prompts
from tests.unit.edge.runtime.test_speculative import _full

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The looping model exported with verify graphs for batches 2, 4 and 8 (the default writes 2 only)."""
    from edge.core.artifacts import atomic_dir, sha256_path
    from edge.model.exits import save_multi_exit
    from exporters.onnx_export import export_onnx

    root, m = tmp_path_factory.mktemp("ort_verify"), copy.deepcopy(_looping())
    for p in m.backbone.parameters():  # the checkpoint stores fp16: compare the same weights
        p.data = p.data.half().float()
    with atomic_dir(root / "ckpt") as tmp:
        save_multi_exit(m, tmp, tokenizer=None, metrics={}, source={})
    export_onnx(m, root / "onnx", ExportConfig(verify_batches=[8, 2, 4]), checkpoint_sha256=sha256_path(root / "ckpt"))
    return m, root / "ckpt", root / "onnx"


@pytest.fixture(scope="module")
def backend(exported):
    _, ckpt, graphs = exported
    return make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)


class _Counted:
    """Counts the backend's verify calls by (B, T)."""

    def __init__(self, backend):
        self.calls: dict[tuple[int, int], int] = {}
        inner = backend.verify

        def verify(x, slots, start):
            key = x.shape[:2]
            self.calls[key] = self.calls.get(key, 0) + 1
            return inner(x, slots, start)

        backend.verify = verify


def _exact_as_full(backend, eng, prompts, max_tokens) -> dict[tuple[int, int], int]:
    """Run ``prompts`` in mode exact on ``eng``, its verify calls counted, and assert the tokens are mode
    full's on the same backend at the same batch and max_len; returns the calls by (B, T)."""
    counted = _Counted(backend)
    try:
        got = _run(eng, prompts, max_tokens=max_tokens, mode=Mode.EXACT)
    finally:
        del backend.verify
    c = eng.cfg
    ref = _run(Engine(backend, EngineConfig(max_len=c.max_len, max_seqs=c.max_seqs, max_running=c.max_running)),
               prompts, max_tokens=max_tokens, mode=Mode.FULL)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in ref]
    return counted.calls


def _engine(backend, batch, costs=None, **cfg) -> Engine:
    spec = cfg.pop("speculative", SpecConfig(**LOOKUP))
    eng = Engine(backend, EngineConfig(**{"max_len": 128, **cfg}, max_seqs=batch, max_running=batch, speculative=spec))
    eng.call_costs = costs if costs is not None else _FlatCosts()
    eng._spec_gate = _AlwaysSpeculate()
    return eng


# ------------------------------------------------------------------------------------------ the graphs
def test_the_export_writes_a_verify_graph_per_batch_size(backend):
    assert ExportConfig().verify_batches == [2]
    assert backend.verify_batches == (2, 4, 8)
    for bad in ([1], [2, 2], [2, "4"], [True], 8, [65]):
        with pytest.raises(ConfigError, match="verify_batches"):
            ExportConfig(verify_batches=bad)
    assert ExportConfig(verify_batches=[8, 2]).verify_batches == [2, 8]


@pytest.mark.parametrize("b,t", [(2, 3), (4, 5), (8, 2)])
def test_verify_equals_each_sequence_verified_alone(backend, b, t):
    """B sequences of different lengths in scattered slots, T new rows each: the logits, tokens and every
    cache row written equal those of one call of the graph of every layer per sequence (the same kernels
    on each row; the matrix products take more rows at once, hence a relative tolerance, which on this
    model's float32 weights measures 0)."""
    rng = np.random.default_rng(b * 10 + t)
    slots = rng.permutation(2 * b)[:b]
    lens = rng.integers(3, 40, b)
    cache = KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, 2 * b, 64)
    backend.attach(cache)
    for s, n in zip(slots, lens):
        backend.full(rng.integers(0, backend.vocab_size, (1, int(n))), np.array([s]), np.array([0]))
    before = [(k.copy(), v.copy()) for k, v in zip(cache.keys, cache.values)]
    x = rng.integers(0, backend.vocab_size, (b, t))
    out = backend.verify(x, slots, lens)
    logits, tokens = out.logits.copy(), out.token.copy()
    after = [(k.copy(), v.copy()) for k, v in zip(cache.keys, cache.values)]
    for (k, v), (k0, v0) in zip(zip(cache.keys, cache.values), before):
        k[...], v[...] = k0, v0
    ref = [backend.full(x[q:q + 1], slots[q:q + 1], lens[q:q + 1], rows=t) for q in range(b)]
    ref_logits = np.concatenate([r.logits.copy() for r in ref])
    scale = float(np.abs(ref_logits).max())
    assert logits.shape == (b * t, backend.vocab_size)
    assert np.abs(logits - ref_logits).max() <= 1e-5 * scale
    top2 = np.sort(ref_logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4 * scale
    assert (tokens == np.concatenate([r.token for r in ref]))[clear].all()
    for (k1, v1), k2, v2 in zip(after, cache.keys, cache.values):
        assert np.abs(k1 - k2).max() <= 1e-5 * (float(np.abs(k2).max()) or 1.0)
        assert np.abs(v1 - v2).max() <= 1e-5 * (float(np.abs(v2).max()) or 1.0)
    # only the new rows were written: every other slot and position is as before
    untouched = np.ones(cache.shape, bool)
    for s, n in zip(slots, lens):
        untouched[s, :, n:n + t] = False
    for (k0, _), (k1, _) in zip(before, after):
        assert np.array_equal(k0[untouched], k1[untouched])


def test_verify_refuses_a_batch_without_a_graph_and_positions_past_the_cache(backend):
    backend.attach(KVCache(backend.num_layers, backend.num_kv_heads, backend.head_dim, 4, 16))
    with pytest.raises(ConfigError, match=r"verifies batches of \[2, 4, 8\] sequences, not 3"):
        backend.verify(np.zeros((3, 2), np.int64), np.arange(3), np.zeros(3, np.int64))
    with pytest.raises(ConfigError, match="exceed the cache capacity 16"):
        backend.verify(np.zeros((2, 4), np.int64), np.arange(2), np.array([3, 13]))


# ------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("batch", [2, 4])
def test_greedy_exact_at_a_verify_batch_equals_full_decoding_on_the_same_graphs(backend, batch):
    """Every verification is one call for the whole batch (rows without a lookup match padded: their token
    is their first row's); the tokens are mode full's on the same backend."""
    eng = _engine(backend, batch)
    calls = _exact_as_full(backend, eng, _looping_prompts(3 * batch, seed=1), 32)
    st = eng.source_stats["lookup"]
    assert st.rounds > 10 and st.accepted > 0 and st.accepted < st.drafted, st.as_dict()
    assert sum(n for (b, _), n in calls.items() if b == batch) > 5, calls
    assert all(t >= 2 for _, t in calls), calls


def test_a_verify_batch_the_costs_say_does_not_pay_takes_plain_steps(backend):
    """Measured costs where a call of T rows per sequence costs T plain steps at batch 2: no drafts can
    pay, so no verify call is made; the tokens are the full model's."""
    costs = CallCosts.fixed({(2, t): float(t) for t in range(1, 8)} | {(1, t): float(t) for t in range(1, 8)})
    eng = _engine(backend, 2, costs)
    calls = _exact_as_full(backend, eng, _looping_prompts(2, seed=4), 16)
    assert calls == {} and eng.spec_stats.rounds == 0 and eng.plain_steps > 0


def test_a_round_near_the_end_of_the_cache_pads_within_it(backend):
    """max_len is the longest prompt plus max_tokens: towards the end the sequences have room for fewer
    rows than their drafts (and than each other's): every round's T fits every slot (no error) and the
    output is still mode full's."""
    prompts = _looping_prompts(6, seed=1)[:4]
    prompts = [prompts[0], prompts[1] + prompts[1]]  # two lengths: the longer one runs out of room first
    max_len = max(map(len, prompts)) + 32
    eng = _engine(backend, 2, max_len=max_len)
    rooms = []
    inner = eng._verify_together

    def spy(seqs):
        rooms.append(min(max_len - s.length for s in seqs))
        return inner(seqs)

    eng._verify_together = spy
    calls = _exact_as_full(backend, eng, prompts, 32)
    assert calls and min(rooms) < max(t for _, t in calls), (rooms, calls)


def test_speculation_gate_follows_whole_iterations_and_retries():
    gate = SpeculationGate()
    assert gate.speculate(4)  # untried: speculation first
    gate.observe(4, True, 0.010, 4)
    assert gate.speculate(4)  # MIN_SAMPLES of each side
    gate.observe(4, True, 0.010, 4)  # 2.5 ms a token
    assert not gate.speculate(4)  # plain untried: measured next
    for _ in range(2):
        gate.observe(4, False, 0.004, 4)  # 1 ms a token: plain wins
    choices = []
    for _ in range(32 + 64 + 128 + 4):
        choices.append(gate.speculate(4))
        gate.observe(4, choices[-1], 0.010 if choices[-1] else 0.004, 4)
    # speculation re-measured after RETRY iterations, then after twice as many each time plain still wins;
    # each re-measurement one iteration, judged alone (its old samples dropped)
    assert [i for i, c in enumerate(choices) if c] == [31, 31 + 64, 31 + 64 + 128]
    assert len(gate.samples[(4, True)]) == 1
    gate.observe(4, True, 0.010, 4)  # a second sample: the window is no longer a probe
    gate.observe(4, True, 100.0, 4)  # a spike (over 3x the window's median rate) is left out
    assert gate.per_token(4, True) == pytest.approx(0.0025)
    gate.observe(4, True, 0.012, 8)  # seconds over tokens, not a mean of rates: 0.032 s / 16 tokens
    assert gate.per_token(4, True) == pytest.approx(0.032 / 16)
    for _ in range(16):
        gate.observe(4, True, 0.0038, 4)  # 0.95 ms a token: not 10% below plain's 1 ms, so plain stays
    assert not gate.speculate(4)
    for _ in range(16):
        gate.observe(4, True, 0.0032, 4)  # 0.8 ms: speculation wins by its margin and runs
    assert gate.per_token(4, True) == pytest.approx(0.0008) and gate.speculate(4)
    assert gate.speculate(2) and gate.per_token(2, True) is None  # another batch size is its own
    assert set(gate.as_dict()) == {"4_spec", "4_plain"}


def test_speculation_gate_judges_a_re_measured_side_on_what_it_costs_now():
    """A side that lost while it was dear (speculation while the acceptance tables learn) wins at its first
    re-measurement once it is cheaper: its old samples do not count against it."""
    gate = SpeculationGate()
    for _ in range(SpeculationGate.WINDOW):  # speculation measured dear: 2.5 ms a token
        gate.observe(4, True, 0.010, 4)
    for _ in range(SpeculationGate.WINDOW):  # plain steps 1 ms a token
        gate.observe(4, False, 0.004, 4)
    choices = []
    for _ in range(SpeculationGate.RETRY + 8):
        choices.append(gate.speculate(4))
        gate.observe(4, choices[-1], 0.0024 if choices[-1] else 0.004, 4)  # speculation now 0.6 ms a token
    first = choices.index(True)
    assert first == SpeculationGate.RETRY - 1 and all(choices[first:]), choices
    assert gate.per_token(4, True) == pytest.approx(0.0006)


def test_one_time_work_is_not_measured(exported):
    """The iterations that open a verify graph or build a binding are left out of the gate (they would count
    a graph's load as the cost of speculating); steady iterations are counted."""
    _, ckpt, graphs = exported
    fresh = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    eng = _engine(fresh, 2)
    gate = eng._spec_gate = SpeculationGate()
    asked, observed = [], []
    speculate, observe = gate.speculate, gate.observe
    gate.speculate = lambda b: asked.append(fresh.setup_events) or speculate(b)
    gate.observe = lambda *a: observed.append(a) or observe(*a)
    setups = fresh.setup_events
    _run(eng, _looping_prompts(4, seed=1)[:2], max_tokens=32, mode=Mode.EXACT)
    assert fresh.setup_events > setups
    assert 0 < len(observed) < len(asked), (len(observed), len(asked))
    # what was left out: the iterations during which the backend did one-time work, no others
    setups_during = sum(1 for a, b in zip(asked, asked[1:] + [fresh.setup_events]) if b > a)
    assert len(observed) == len(asked) - setups_during


def test_a_batch_where_speculation_measured_dearer_takes_plain_steps(backend):
    """The gate has measured whole iterations with drafts dearer per token than plain ones at batch 2:
    the engine steps (no verify call, no per-row draft) except for the gate's periodic re-measurement."""
    eng = _engine(backend, 2)
    gate = eng._spec_gate = SpeculationGate()
    gate.samples = {(2, True): [(1.0, 1)] * 3, (2, False): [(0.001, 1)] * 3}
    gate.RETRY = 10 ** 6
    calls = _exact_as_full(backend, eng, _looping_prompts(2, seed=4), 16)
    assert calls == {} and eng.spec_stats.rounds == 0 and eng.plain_steps >= 2 * 14


def test_the_generic_verify_is_each_sequence_alone():
    """A backend without verify graphs still answers ``verify`` (sequence by sequence), so the engine's
    round logic can run on it; it lists no batch size, so the engine never chooses it there."""
    m = _looping()
    tb = TorchBackend(m)
    assert tb.verify_batches == ()
    tb.verify_batches = (2,)
    prompts = _looping_prompts(4, seed=5)
    eng = _engine(tb, 2)
    got = _run(eng, prompts, max_tokens=20, mode=Mode.EXACT)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in _full(m, prompts, 20)]
    assert eng.source_stats["lookup"].rounds > 0


def test_call_costs_of_several_rows_of_several_sequences_grow_with_their_rows():
    """A verify call's matrix products are compute-bound in its B * T rows: estimated from a plain step at
    the same batch by 1 + 0.1 (B T - 1) (measured 1.8-2.0 for C(4, 4) / C(4, 1) on a 2-core CPU)."""
    costs = CallCosts.fixed({(4, 1): 2.0})
    assert costs.cost(4, 4) / costs.cost(4, 1) == pytest.approx((1 + 0.1 * 15) / (1 + 0.1 * 3))
    for _ in range(2):  # the first call of a shape builds its bindings and is not counted
        costs.observe(4, 4, 5.0)
    assert costs.cost(4, 4) == 5.0
    assert costs.cost(4, 3) == pytest.approx(5.0 * 2.1 / 2.5)  # a measured shape sets its neighbours' estimates


@pytest.mark.slow  # ~10 s: hundreds of sampled requests
def test_sampled_exact_at_a_verify_batch_is_distributed_as_the_full_model():
    """Two sequences a round (the generic verify on torch), lookup drafts, temperature 1: chi-square of
    the first three tokens' joint against the full model's exact joint."""
    from tests.unit.edge.runtime.test_lookup_drafts import LOOP_PROMPT
    from tests.unit.edge.runtime.test_speculative_sampling import (ALPHA, _chisquare, _engine_joint, _exact_joint,
                                                                   _sampling_model)

    m = _sampling_model()
    tb = TorchBackend(m)
    tb.verify_batches = (2,)
    eng = _engine(tb, 2, max_len=16, speculative=SpecConfig(max_draft=3, **LOOKUP))
    counts = _engine_joint(eng, LOOP_PROMPT, 1.0, 1.0, 640)
    st = eng.source_stats["lookup"]
    assert st.rounds > 100 and 0 < st.accepted < st.drafted, st.as_dict()
    p = _chisquare(counts, _exact_joint(m, 1.0, 1.0, LOOP_PROMPT))
    assert p > ALPHA, p


def test_verify_costs_from_files_name_what_is_missing(exported):
    """The projection's rho(k) from graph files: a batch without its verify graph, or a head that also decides
    (it needs the previous exit's inputs), is a clear error before anything is timed."""
    from edge.pipeline.bench.verify_cost import verify_costs
    from edge.runtime.graphs import FUSED_DIR

    _, _, graphs = exported
    cfg = _looping().backbone.cfg
    args = (graphs / FUSED_DIR, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size, 8)
    with pytest.raises(ConfigError, match=r"no verify graph for batches \[3\]"):
        verify_costs(*args, batches=[1, 3])
    with pytest.raises(ConfigError, match="decision head"):
        verify_costs(*args, batches=[1, 2], repeats=1)


def test_speculation_gate_per_token_is_the_spike_free_ratio():
    """per_token (plain Python, cached until the next observation) is the seconds over tokens of the window's
    iterations not slower per token than SPIKE times the median rate, as numpy computes it, for windows of
    odd and even length, with and without spikes."""
    rng = np.random.default_rng(0)
    for n in range(SpeculationGate.MIN_SAMPLES, SpeculationGate.WINDOW + 4):
        gate = SpeculationGate()
        got = [(float(rng.uniform(1e-3, 3e-3)) * (10.0 if rng.random() < 0.2 else 1.0), int(rng.integers(1, 9)))
               for _ in range(n)]
        for sec, tok in got:
            gate.observe(4, True, sec, tok)
            gate.per_token(4, True)  # asked between observations: the cache must follow them
        secs, toks = np.array(got[-SpeculationGate.WINDOW:]).T
        keep = secs / toks <= SpeculationGate.SPIKE * np.median(secs / toks)
        assert gate.per_token(4, True) == pytest.approx(secs[keep].sum() / toks[keep].sum(), rel=1e-12)
    assert gate.per_token(4, False) is None
    # an even window's median is the mean of its middle two: 2 ms here keeps the 4 ms iteration (the lower
    # middle, 1 ms, would drop it); 2.2 ms drops the 6.7 ms one (the upper middle, 2.4 ms, would keep it)
    for rates, kept in (([1, 1, 3, 4], [1, 1, 3, 4]), ([1, 2, 2.4, 6.7], [1, 2, 2.4])):
        gate = SpeculationGate()
        for r in rates:
            gate.observe(2, False, r * 1e-3, 1)
        assert gate.per_token(2, False) == pytest.approx(sum(kept) * 1e-3 / len(kept))
