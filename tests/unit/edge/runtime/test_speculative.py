"""Mode exact (self-speculative decoding, edge/runtime/speculative.py), greedy: the full model's tokens
for every stop rule, batch size and backend; rejected rows never corrupt the committed cache; stop ids,
max_tokens and cancels end a request where full decoding does; the stop rules and their costs;
configuration errors. Sampling is tested in test_speculative_sampling.py.

Two regimes, on purpose: a random model, whose first exit rarely drafts the full model's token (rounds
end in an immediate rejection), and an *agreeing* model whose first exit usually does (long accepted
drafts, rejections mid-round). Each test checks ``spec_stats`` to prove its regime actually ran.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

import edge.runtime.rounds as rounds_module
from edge.core.errors import ConfigError, SmartExitError
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.reference import reference_generate
from edge.runtime.backend import make_backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.request import NO_TOKEN, Mode, Request
from edge.runtime.rules import TOP1, ConfidenceRule, NeverExit
from edge.runtime.spec_costs import DraftCosts
from edge.runtime.spec_length import include_next
from edge.runtime.speculative import SpecConfig, StopRule
from edge.runtime.torch_backend import TorchBackend
from tests.tolerance import assert_f32_close
from tests.unit.edge.runtime.test_engine import CFG, _model, _prompts, _run

torch.set_num_threads(1)  # the machine is shared; tiny models need no more (as tests/unit/exporters do)

NEW = 32  # new tokens per request (fast tier)
AGREE_SCALE = 0.05


class _Agreement(NeverExit):
    """NeverExit plus the calibrators' interface the calibrated stop rule reads (the threshold table's
    ``TableRule.agreement``): a probability [B] per draft row. ``p`` None: the draft exit's top-1
    probability (feature column TOP1) to the power 0.02, 0.91..1 for top-1 0.01..1: draft lengths vary
    around 5 on the cost priors; else the constant ``p``."""

    def __init__(self, p: float | None = None) -> None:
        self.p = p
        self.asked: set[tuple[int, int]] = set()  # (layer, number of features)

    def agreement(self, layer, features):
        self.asked.add((layer, features.shape[1]))
        if self.p is not None:
            return np.full(features.shape[0], self.p)
        return features[:, TOP1].astype(np.float64) ** 0.02


class _FrozenCosts(DraftCosts):
    """The cost priors, never updated from measured times: the calibrated rule becomes deterministic."""

    def observe_step(self, seconds):
        pass

    def observe_verify(self, rows, seconds):
        pass


@functools.lru_cache(maxsize=None)
def _kind(kind: str, gate_hidden: int = 0) -> MultiExitModel:
    """``random``: test_engine's model. ``agreeing``: layers 3..6 add only AGREE_SCALE times their
    attention / MLP outputs to the residual, and exit 2's head is the final norm + shared LM head
    (adapter zeroed), so exit 2 usually drafts the full model's token (with scale 0, always). Measured
    with 6-token drafts: acceptance ~0.67, mean accepted length ~3.7, rejections anywhere in a round."""
    m = _model(seed=0, gate_hidden=gate_hidden)
    if kind == "agreeing":
        with torch.no_grad():
            for layer in m.backbone.layers[2:]:
                layer.self_attn.o_proj.weight.mul_(AGREE_SCALE)
                layer.mlp.down_proj.weight.mul_(AGREE_SCALE)
            head = m.heads["2"]
            head.up.weight.zero_()
            head.norm.weight.copy_(m.backbone.norm.weight)
    return m


def _full(m, prompts, n, **kw):
    """Full-depth decoding of ``prompts``, all at once (the reference the exact engine must equal)."""
    cfg = EngineConfig(max_seqs=len(prompts), max_running=len(prompts), max_len=128, **kw)
    return _run(Engine(TorchBackend(m), cfg), prompts, max_tokens=n, mode="full")


def _batched(eng, prompts, lengths, **kw):
    """Submit every prompt (mode exact, its own max_tokens) and run; (token, exit layer) per request."""
    ids = [eng.submit(Request(p, n, mode="exact", **kw)) for p, n in zip(prompts, lengths)]
    out: dict[int, list] = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id].append((ev.token, ev.exit_layer))
    return [out[i] for i in ids]


EXIT = dict(sources=("exit",))  # exit drafts only (lookup drafts: test_lookup_drafts.py)
STOPS = {
    "fixed1": dict(stop="fixed", fixed=1, **EXIT),
    "fixed7": dict(stop="fixed", fixed=7, max_draft=7, **EXIT),  # 8 verification rows: the backends' limit
    "top1": dict(stop="top1", top1=0.1, **EXIT),
    "calibrated": dict(stop="calibrated", **EXIT),
}


def _engine(m, stop, max_len=128, **cfg):
    """An engine for mode exact with stop rule ``stop`` (STOPS) on model ``m`` (or a backend). The calibrated
    rule runs on the cost priors: with measured times its draft lengths, and so the regime checks,
    would depend on the machine's load."""
    backend = TorchBackend(m) if isinstance(m, MultiExitModel) else m
    eng = Engine(backend, EngineConfig(max_len=max_len, speculative=SpecConfig(**STOPS[stop]), **cfg),
                 _Agreement() if stop == "calibrated" else None)
    if stop == "calibrated":
        eng.spec_costs = _FrozenCosts(2, CFG.num_layers, eng.cfg.speculative.max_draft + 1)
    return eng


def _check_regime(kind, stop, st):
    """The run exercised what the model is for: rejections (random) or long accepted drafts (agreeing)."""
    assert st.drafted > 0, "nothing was drafted: the test would compare full decoding with itself"
    if kind == "random":
        assert st.acceptance_rate < 0.3, st.as_dict()
    elif stop == "fixed1":
        assert st.acceptance_rate > 0.6, st.as_dict()
    else:
        assert st.accepted / st.rounds > 2 and st.accepted < st.drafted, st.as_dict()


# the random model rejects most drafts, so its rounds are many: 4-5 s a stop rule; its fixed1 case and every
# agreeing case (1-2 s) stay in make test-fast
GREEDY_CASES = [pytest.param(kind, stop, id=f"{kind}-{stop}",
                             marks=pytest.mark.slow if kind == "random" and stop != "fixed1" else ())
                for kind in ("random", "agreeing") for stop in STOPS]


@pytest.mark.parametrize("kind,stop", GREEDY_CASES)
def test_greedy_exact_equals_full_decoding(kind, stop):
    """Batch 1 (one request at a time) and batched with continuous batching (more requests than
    max_running, prompts chunked by a small prefill budget, some ending at the cache's last position):
    every token is the full model's, and the rounds emitted exactly the decoded tokens."""
    m = _kind(kind)
    prompts = _prompts(10, seed=40, lo=1, hi=30)
    full = _full(m, prompts, NEW)
    for p, ref in zip(prompts[:2], full):
        assert [t for t, _ in ref] == reference_generate(m, p, NEW).tokens

    eng = _engine(m, stop, max_seqs=1)
    one = [_run(eng, [p], max_tokens=NEW, mode="exact")[0] for p in prompts[:3]]
    assert one == full[:3]
    _check_regime(kind, stop, eng.spec_stats)

    # requests of different lengths in one batch: each round's drafts are capped per sequence
    lengths = [NEW - 9 * (k % 3) for k in range(len(prompts))]
    eng = _engine(m, stop, max_seqs=4, max_running=4, prefill_budget=8, speculate_max_batch=None,
                  max_len=max(map(len, prompts)) + NEW)  # the longest request fills the cache to its end
    assert _batched(eng, prompts, lengths) == [ref[:n] for ref, n in zip(full, lengths)]
    _check_regime(kind, stop, eng.spec_stats)
    assert eng.spec_stats.emitted == sum(lengths) - len(prompts)  # the first token of each comes from prefill
    assert not eng.has_work and eng.cache.free_slots == 4
    if stop == "calibrated":
        assert eng.rule.asked == {(2, 6)}  # the draft exit's six features


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "agreeing"])
def test_greedy_exact_equals_full_decoding_many_prompts(kind):
    """The sweep: 24 prompts of 1..47 tokens, 40 new tokens, every stop rule, batch 1 and batched."""
    m = _kind(kind)
    prompts = _prompts(24, seed=41, lo=1, hi=48)
    full = _full(m, prompts, 40)
    for stop in STOPS:
        eng = _engine(m, stop, max_seqs=1)
        assert [_run(eng, [p], max_tokens=40, mode="exact")[0] for p in prompts[:8]] == full[:8], stop
        _check_regime(kind, stop, eng.spec_stats)
        eng = _engine(m, stop, max_seqs=6, max_running=6, prefill_budget=16, speculate_max_batch=None)
        assert _run(eng, prompts, max_tokens=40, mode="exact") == full, stop
        _check_regime(kind, stop, eng.spec_stats)


def test_exact_from_the_second_exit_with_gates_and_in_mixed_batches():
    """Drafting from exit 4 (two segments per draft step); a model with exit gates (the draft exit's
    head runs apart); requests in modes exact, full and bounded in one batch, the bounded ones exiting
    early, in both KV modes; a sliding-window model; and a speculation limit of 2 with 3 running (exact
    rows decode at full depth while the batch is larger): the exact requests always get the full
    model's tokens."""
    m = _kind("random")
    prompts = _prompts(4, seed=42, lo=2, hi=20)
    full = _full(m, prompts, 20)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=4, max_running=4, max_len=128, speculate_max_batch=None,
                                               speculative=SpecConfig(**EXIT, draft_exit=4, stop="fixed", fixed=2)))
    assert _run(eng, prompts, max_tokens=20, mode="exact") == full and eng.spec_stats.drafted > 0

    gated = _kind("random", gate_hidden=8)
    eng = Engine(TorchBackend(gated), EngineConfig(max_seqs=2, max_running=2, max_len=128, speculate_max_batch=None,
                                                   speculative=SpecConfig(**EXIT, stop="calibrated")), _Agreement())
    assert _run(eng, prompts[:2], max_tokens=20, mode="exact") == _full(gated, prompts[:2], 20)
    assert eng.spec_stats.drafted > 0 and eng.rule.asked == {(2, 3)}  # the gated exits' three features

    for kv_mode in KVMode:  # deferral: the bounded row's skipped layers run later, with its next token
        eng = Engine(TorchBackend(m), EngineConfig(max_seqs=4, max_running=4, max_len=128, speculate_max_batch=None,
                                                   kv_mode=kv_mode, defer_exit_max_batch=None,
                                                   speculative=SpecConfig(**EXIT, stop="fixed", fixed=3)), ConfidenceRule(0.0))
        modes = ["exact", "bounded", "exact", "full"]
        ids = [eng.submit(Request(p, 20, mode=mode)) for p, mode in zip(prompts, modes)]
        got: dict[int, list] = {}
        while eng.has_work:
            for ev in eng.step():
                got.setdefault(ev.request_id, []).append((ev.token, ev.exit_layer))
        assert [got[ids[i]] for i in (0, 2, 3)] == [full[i] for i in (0, 2, 3)], kv_mode
        assert all(e == 2 for _, e in got[ids[1]][1:])  # the bounded row exits at the first exit
        assert eng.spec_stats.rounds > 0

    windowed = _model(seed=7, sliding_window=8)  # verification rows see only the last 8 positions
    p = _prompts(1, seed=7, lo=15, hi=16)[0]
    eng = _engine(windowed, "fixed7", max_seqs=1, prefill_budget=5)
    assert [t for t, _ in _run(eng, [p], max_tokens=20, mode="exact")[0]] == reference_generate(windowed, p, 20).tokens

    # batch 3 (full depth) until the short request ends; 2 (speculating) while the fourth prefills; 3 again
    eng = _engine(m, "fixed7", max_seqs=3, max_running=3, speculate_max_batch=2)
    order, lengths = [0, 3, 1, 2], [20, 6, 20, 20]
    ids = [eng.submit(Request(prompts[k], n, mode="exact")) for k, n in zip(order, lengths)]
    events = []
    while eng.has_work:
        events += eng.step()
    for i, k, n in zip(ids, order, lengths):
        assert [e.token for e in events if e.request_id == i] == [t for t, _ in full[k][:n]]
    assert 0 < eng.spec_stats.emitted < 3 * 19 + 5  # and some from full-depth steps


# ------------------------------------------------------------------------------------- ONNX Runtime
@pytest.fixture(scope="module")
def exported_agreeing(tmp_path_factory):
    """The agreeing model exported to fused ONNX Runtime graphs (test_ort_backend's ``_export``, which
    rounds the weights to fp16 in place: a copy, the cached model stays as it is)."""
    from tests.unit.edge.runtime.test_ort_backend import _export

    return _export(tmp_path_factory.mktemp("ort_spec"), copy.deepcopy(_kind("agreeing")))


@pytest.mark.slow  # ~10 s with the export it alone uses; exact speculation on torch stays in make test-fast
@pytest.mark.parametrize("batch", [1, 4])
def test_exact_on_onnx_runtime(exported_agreeing, batch):
    """On the fused graphs (drafts from the export's int8 draft head, verification reads the last exit at
    R rows, drafts of a shrinking batch come from scattered slots): the full model's tokens, long
    accepted drafts and rejections both seen, and every committed cache position as full-depth decoding
    on ONNX Runtime left it."""
    m, ckpt, graphs = exported_agreeing
    prompts = _prompts(3 if batch == 1 else 4, seed=46, lo=1, hi=25)
    full = _full(m, prompts, NEW)
    cfg = dict(max_seqs=1) if batch == 1 else dict(max_seqs=4, max_running=4, prefill_budget=8,
                                                   speculate_max_batch=None)
    ort_full = Engine(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1),
                      EngineConfig(max_len=128, **cfg))
    for stop in ("fixed7", "top1"):
        eng = _engine(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1), stop, **cfg)
        if batch == 1:
            assert [_run(eng, [p], max_tokens=NEW, mode="exact")[0] for p in prompts] == full, stop
        else:
            assert _run(eng, prompts, max_tokens=NEW, mode="exact") == full, stop
            if stop == "fixed7":
                assert _run(ort_full, prompts, max_tokens=NEW, mode="full") == full
                _assert_same_cache(eng, ort_full, [len(p) + NEW - 1 for p in prompts], "onnxruntime")
        _check_regime("agreeing", stop, eng.spec_stats)
    # drafting from exit 4: two draft segments per step, the first one's head only feeds the second's features
    eng = Engine(make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1),
                 EngineConfig(max_len=128, speculative=SpecConfig(**EXIT, draft_exit=4, stop="fixed", fixed=3), **cfg))
    assert _batched(eng, prompts, [NEW] * len(prompts)) == full and eng.spec_stats.drafted > 0


# ------------------------------------------------------------------------------------------ rollback
def _assert_same_cache(eng, ref, lengths, what):
    """Every committed position of every slot holds what full-depth decoding wrote there (a
    verification of R rows vs R one-row steps: summation order only, through up to 6 layers)."""
    for j in range(CFG.num_layers):
        for slot, n in enumerate(lengths):
            for got, want in ((eng.cache.keys[j], ref.cache.keys[j]), (eng.cache.values[j], ref.cache.values[j])):
                assert_f32_close(got[slot, :, :n], want[slot, :, :n], CFG.hidden_size, CFG.num_layers,
                                 f"{what}: layer {j} slot {slot}")


@pytest.mark.parametrize("kind,stop", [("random", "fixed7"), ("agreeing", "top1")])
def test_rejected_rows_never_corrupt_committed_ones(kind, stop):
    """After runs full of rejections (rows written past the committed length, then overwritten by the
    next round), the cache of every committed position equals the full-depth engine's. Each request
    keeps its own slot (max_seqs = requests), so the caches can be compared slot by slot."""
    m = _kind(kind)
    prompts = _prompts(5, seed=43, lo=1, hi=25)
    cfg = dict(max_seqs=5, max_running=5, max_len=128, prefill_budget=12)
    ref = Engine(TorchBackend(m), EngineConfig(**cfg))
    full = _run(ref, prompts, max_tokens=NEW, mode="full")
    eng = _engine(m, stop, speculate_max_batch=None, **{k: v for k, v in cfg.items() if k != "max_len"})
    assert _run(eng, prompts, max_tokens=NEW, mode="exact") == full
    st = eng.spec_stats
    assert st.drafted - st.accepted > 20, st.as_dict()  # rejected rows were written
    _assert_same_cache(eng, ref, [len(p) + NEW - 1 for p in prompts], kind)


# ---------------------------------------------------------------------- stop ids, max_tokens, cancels
def _steps(eng, prompts, n, **kw):
    """Run to the end; returns (events, the tokens of each request grouped by the step that emitted them)."""
    ids = [eng.submit(Request(p, n, mode="exact", **kw)) for p in prompts]
    events, rounds = [], {i: [] for i in ids}
    while eng.has_work:
        step = eng.step()
        events += step
        for i in ids:
            toks = [e.token for e in step if e.request_id == i and e.token != NO_TOKEN]
            if toks:
                rounds[i].append(toks)
    return ids, events, [rounds[i] for i in ids]


def _inside_a_round(rounds, full):
    """An output index i whose token is emitted by a round that emits more after it, and whose token
    does not occur earlier in the output (so it can serve as a stop id)."""
    index = 0
    for toks in rounds:
        for q in range(len(toks) - 1):
            i = index + q
            if i > 0 and full[i] not in full[:i]:
                return i
        index += len(toks)
    raise AssertionError("no multi-token round: the agreeing model should accept drafts")


def test_stop_ids_and_max_tokens_inside_an_accepted_run():
    """A stop id, or max_tokens, that falls in the middle of a round's accepted drafts ends the request
    there, as full decoding does: the round's later tokens are dropped, one finish event."""
    m = _kind("agreeing")
    prompt = _prompts(1, seed=44, lo=8, hi=9)[0]
    full = [t for t, _ in _full(m, [prompt], NEW)[0]]
    _, _, (rounds,) = _steps(_engine(m, "fixed7", max_seqs=1), [prompt], NEW)
    assert any(len(r) > 2 for r in rounds)
    i = _inside_a_round(rounds, full)

    eng = _engine(m, "fixed7", max_seqs=1)
    ids, events, _ = _steps(eng, [prompt], NEW, stop_ids=(full[i],))
    assert [e.token for e in events] == full[:i + 1]
    assert [(e.finished, e.finish_reason) for e in events][-2:] == [(False, None), (True, "stop")]
    assert not eng.has_work and eng.cache.free_slots == 1

    eng = _engine(m, "fixed7", max_seqs=1)
    for n in range(1, 16):
        ids, events, _ = _steps(eng, [prompt], n)
        assert [e.token for e in events] == full[:n], n
        assert [e.finish_reason for e in events] == [None] * (n - 1) + ["length"]
        assert [e.index for e in events] == list(range(n))
    assert eng.spec_stats.emitted == sum(range(15))  # rounds never produce past max_tokens


def test_cancel_from_a_callback_drops_the_rest_of_the_round():
    """A request that cancels itself on a token in the middle of a round gets no later token of that
    round; a request cancelled by another's callback before its round's tokens are emitted (it holds
    a later slot) loses that whole round. Rounds are deterministic (fixed stop rule), so where they end
    is read from an uncancelled run."""
    m = _kind("agreeing")
    prompts = _prompts(2, seed=45, lo=5, hi=15)
    full = [[t for t, _ in seq] for seq in _full(m, prompts, NEW)]
    cfg = dict(max_seqs=2, max_running=2, speculate_max_batch=None)
    _, _, rounds = _steps(_engine(m, "fixed7", **cfg), prompts, NEW)
    i = _inside_a_round(rounds[0], full[0])  # A cancels itself on token i, mid-round
    # B's round that runs in the same step as A's round holding index i: B has emitted `before` tokens
    step = next(s for s in range(len(rounds[0])) if sum(map(len, rounds[0][:s + 1])) > i)
    before = sum(map(len, rounds[1][:step]))

    eng = _engine(m, "fixed7", **cfg)
    ids: list[int] = []
    calls = []

    def on_a(ev):
        if ev.index == i and ev.token != NO_TOKEN:
            calls.append((eng.cancel(ids[1]), eng.cancel(ids[0])))

    ids.append(eng.submit(Request(prompts[0], NEW, mode="exact", on_token=on_a)))
    ids.append(eng.submit(Request(prompts[1], NEW, mode="exact")))
    events = []
    while eng.has_work:
        events += eng.step()
    assert calls == [(True, True)]
    a = [e for e in events if e.request_id == ids[0]]
    b = [e for e in events if e.request_id == ids[1]]
    assert [e.token for e in a[:-1]] == full[0][:i + 1]
    assert (a[-1].token, a[-1].index, a[-1].finish_reason) == (NO_TOKEN, i + 1, "cancelled")
    assert [e.token for e in b[:-1]] == full[1][:before] and rounds[1][step]  # B's round was dropped
    assert (b[-1].token, b[-1].index, b[-1].finish_reason) == (NO_TOKEN, before, "cancelled")
    assert not eng.has_work and eng.cache.free_slots == 2


# ------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("kw,msg", [
    (dict(stop="longest"), "speculative.stop must be one of calibrated, fixed, top1"),
    (dict(max_draft=0), "max_draft must be in 1..7"),
    (dict(max_draft=8), "max_draft must be in 1..7"),
    (dict(stop="fixed", max_draft=3, fixed=4), r"fixed must be in 1..max_draft \(3\)"),
    (dict(stop="fixed", fixed=0), "fixed must be in 1..max_draft"),
    (dict(top1=1.5), r"top1 must be in \[0, 1\]"),
])
def test_spec_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        SpecConfig(**kw)


def test_fixed_length_is_checked_only_for_the_fixed_rule():
    assert SpecConfig(stop="top1", max_draft=2).max_draft == 2  # the unused default fixed=3 is no error


def test_engine_config_errors_and_refused_requests():
    m = _kind("random")
    for draft in (3, 6):  # not an exit; the last exit (not a decision exit)
        with pytest.raises(ConfigError, match=f"draft_exit {draft} is not a decision exit"):
            Engine(TorchBackend(m), EngineConfig(max_len=64, speculative=SpecConfig(draft_exit=draft)))
    with pytest.raises(ConfigError, match="speculate_max_batch"):
        EngineConfig(speculate_max_batch=0)
    assert EngineConfig(speculative={"stop": "top1", "draft_exit": 4}).speculative == SpecConfig(draft_exit=4,
                                                                                               stop=StopRule.TOP1)
    with pytest.raises(ConfigError, match="max_draft"):
        EngineConfig(speculative={"max_draft": 9})

    # stop "calibrated" by default; exit drafts only (lookup drafts need no calibrators, nor an exit)
    eng = Engine(TorchBackend(m), EngineConfig(max_len=64, speculative=SpecConfig(**EXIT)), NeverExit())
    with pytest.raises(SmartExitError, match="calibrated draft-length rule needs the threshold table's calibrators"):
        eng.submit(Request([1, 2, 3], 4, mode="exact"))
    assert not eng.has_work
    eng = Engine(TorchBackend(m), EngineConfig(max_len=64, speculative=SpecConfig(stop="fixed")), NeverExit())
    assert _run(eng, [[1, 2, 3]], max_tokens=8, mode=Mode.EXACT) == _full(m, [[1, 2, 3]], 8)

    torch.manual_seed(0)
    one_exit = MultiExitModel(_model().backbone, ExitConfig(layers=[CFG.num_layers], adapter_rank=0)).eval()
    eng = Engine(TorchBackend(one_exit), EngineConfig(max_len=64, speculative=SpecConfig(stop="fixed", **EXIT)))
    with pytest.raises(SmartExitError, match="this model has none; use 'full'"):
        eng.submit(Request([1, 2, 3], 4, mode="exact"))


# ------------------------------------------------------------------------- stop rules and their costs
def test_fixed_and_top1_rules():
    fixed = SpecConfig(stop="fixed", fixed=3, max_draft=5)
    costs = DraftCosts(2, 6, 6)
    assert [include_next(fixed, k, [], 0.0, costs) for k in range(7)] == [True] * 3 + [False] * 4
    top1 = SpecConfig(stop="top1", top1=0.6, max_draft=2, fixed=1)
    assert include_next(top1, 0, [], 0.6, costs) and not include_next(top1, 0, [], 0.59, costs)
    assert include_next(top1, 1, [], 1.0, costs) and not include_next(top1, 2, [], 1.0, costs)  # max_draft


def test_calibrated_rule_maximises_expected_tokens_per_second():
    """Draft k + 1 joins exactly when it raises E(k) / C(k), the round's expected tokens over its cost
    (module docstring), for any agreement and any measured costs; certain agreement drafts up to
    max_draft, zero agreement never drafts."""
    rule = SpecConfig(stop="calibrated", max_draft=7)
    rng = np.random.default_rng(0)
    for trial in range(300):
        costs = DraftCosts(2, 6, 8)
        for _ in range(trial % 4):  # priors only, then more and more measured shapes
            costs.observe_step(rng.uniform(1e-3, 3e-3))
            rows = int(rng.integers(1, 9))
            costs.observe_verify(rows, rng.uniform(2e-3, 9e-3))
            costs.observe_verify(rows, rng.uniform(2e-3, 9e-3))
        probs = list(rng.uniform(0.0, 1.0, 8) ** rng.uniform(0.1, 2.0))

        def rate(k):
            return (1.0 + sum(np.prod(probs[:n]) for n in range(1, k + 1))) / costs.round(k)

        for k in range(7):
            want = rate(k + 1) > rate(k)
            if abs(rate(k + 1) - rate(k)) > 1e-9 * rate(k):  # not a tie up to rounding
                assert include_next(rule, k, probs[:k + 1], 0.0, costs) == want, (trial, k)
        assert not include_next(rule, 7, probs, 1.0, costs)
    costs = DraftCosts(2, 6, 8)
    assert all(include_next(rule, k, [1.0] * (k + 1), 0.0, costs) for k in range(7))
    assert not any(include_next(rule, k, [0.0] * (k + 1), 1.0, costs) for k in range(7))


def test_draft_costs_priors_measurements_and_estimates():
    c = DraftCosts(2, 6, 8)
    assert c.step == pytest.approx(1 / 3) and c.round(0) == pytest.approx(1.0)  # layer shares of one step
    assert c.verification(3) == pytest.approx(2 / 3 * (1 + 2 * DraftCosts.ROW_GROWTH))
    c.observe_step(5.0)  # the first call of each shape builds bindings: ignored
    c.observe_step(0.01)
    assert c.step == 0.01 and c.verification(1) == pytest.approx(0.02)  # the prior verification rescaled
    c.observe_step(0.02)
    assert c.step == pytest.approx(0.01 + DraftCosts.ALPHA * 0.01)
    c.observe_verify(4, 9.0)
    assert c.verification(4) == pytest.approx(0.02 * (1 + 3 * DraftCosts.ROW_GROWTH))  # still the prior
    c.observe_verify(4, 0.05)
    c.observe_verify(4, 0.10)
    assert c.verification(4) == pytest.approx(0.05 + DraftCosts.ALPHA * 0.05)
    v4 = c.verification(4)
    assert c.verification(6) == pytest.approx(v4 * (1 + 2 * DraftCosts.ROW_GROWTH))  # nearest measured
    assert c.verification(1) == pytest.approx(v4 * (1 - 3 * DraftCosts.ROW_GROWTH))
    assert c.round(3) == pytest.approx(4 * c.step + v4)
    assert c.as_dict()["verify_s_by_rows"] == {4: pytest.approx(v4)}


def _drafts_per_round(monkeypatch):
    """Spy on the engine's greedy acceptance: the number of drafts each round verified."""
    seen = []
    accept = rounds_module.accept_greedy
    monkeypatch.setattr(rounds_module, "accept_greedy", lambda drafts, full: seen.append(len(drafts)) or
                        accept(drafts, full))
    return seen


@pytest.mark.parametrize("stop,p,want", [("fixed", None, 3), ("calibrated", 1.0, 6), ("calibrated", 0.0, 0)])
def test_drafts_per_round_in_the_engine(monkeypatch, stop, p, want):
    """Every round drafts ``want`` tokens (fixed k = 3; calibrated with certain agreement: max_draft; with
    zero agreement: none) unless max_tokens leaves fewer: cap = tokens still to emit - 1. The calibrated
    rule runs on the cost priors (measured times would make its lengths machine-dependent)."""
    seen = _drafts_per_round(monkeypatch)
    m = _kind("random")
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128, speculative=SpecConfig(**EXIT, stop=stop, fixed=3)),
                 _Agreement(p))
    eng.spec_costs = _FrozenCosts(2, CFG.num_layers, 7)
    n = 24
    _, events, (rounds,) = _steps(eng, [[5, 6, 7]], n)
    assert [e.token for e in events] == [t for t, _ in _full(m, [[5, 6, 7]], n)[0]]
    left = n - 1  # tokens still to emit when each round starts (the first comes from prefill)
    expected = []
    for toks in rounds[1:]:
        expected.append(min(want, left - 1))
        left -= len(toks)
    assert seen == expected and eng.spec_stats.drafted == sum(expected)


def test_calibrated_rule_recovers_from_one_outlier_measurement():
    """Measured costs are moving averages so that the rule follows the machine. Here the second
    2-row verification (the first one counted) takes 50x its usual time once; afterwards every round
    verifies 1 row in the usual time. With agreement 0.95 the rule must draft again: an observation
    counts at most DraftCosts.OUTLIER times the estimate, and no length's estimate exceeds CAP times what
    the cheapest measured length predicts (else 2 rows, never verified again, would stay at the outlier)."""
    rule = SpecConfig(stop="calibrated")
    costs = DraftCosts(2, 6, rule.max_draft + 1)
    for _ in range(3):  # a normal start: draft steps 1 ms, verifications of 1 and 2 rows 2 ms
        costs.observe_step(1e-3)
        costs.observe_verify(1, 2e-3)
    costs.observe_verify(2, 2e-3)
    assert include_next(rule, 0, [0.95], 0.0, costs)
    costs.observe_verify(2, 0.1)  # the first counted 2-row verification hits a pause
    drafted = []
    for _ in range(200):  # the engine's loop: a round that drafts nothing verifies 1 row
        include = include_next(rule, 0, [0.95], 0.0, costs)
        drafted.append(include)
        costs.observe_step(1e-3)
        costs.observe_verify(2 if include else 1, 2e-3)
    assert any(drafted)
