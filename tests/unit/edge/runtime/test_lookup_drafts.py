"""Mode exact with lookup drafts (edge/runtime/speculative.py, edge/model/lookup.py): the drafts, the
choice of source and length from measured costs, and the engine's output, which must be the full
model's token for token (greedy) and distributed as the full model's (sampling, with a negative
control). Exit drafts alone are tested in test_speculative.py and test_speculative_sampling.py.

The model is test_engine's random one with its attention outputs scaled by LOOP_SCALE: its next token
depends mostly on the current one, so greedy continuations fall into loops after a few tokens and
lookup drafts are accepted for long runs there, and rejected where the prompt's own continuations
differ from the model's. Each test checks ``source_stats`` to prove its regime ran."""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

import edge.runtime.rounds as rounds_module
from edge.core.errors import ConfigError
from edge.model.lookup import Lookup
from edge.runtime.backend import make_backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig
from edge.runtime.request import Mode, Request
from edge.runtime.spec_costs import CallCosts
from edge.runtime.spec_gates import ExitDraftGate, SpeculationGate
from edge.runtime.spec_length import LookupAcceptance, lookup_length
from edge.runtime.speculative import SpecConfig
from edge.runtime.torch_backend import TorchBackend
from tests.unit.edge.runtime.test_engine import _model, _run
from tests.unit.edge.runtime.test_speculative import _full
from tests.unit.edge.runtime.test_speculative_sampling import (ALPHA, PROMPT, V, _chisquare, _engine_joint, _exact_joint,
                                                        _sampling_model)

torch.set_num_threads(1)

LOOKUP = dict(sources=("lookup",))
LOOP_SCALE = 0.02


@functools.lru_cache(maxsize=None)
def _looping(seed: int = 0):
    m = _model(seed=seed)
    with torch.no_grad():
        for layer in m.backbone.layers:
            layer.self_attn.o_proj.weight.mul_(LOOP_SCALE)
    return m


class _FlatCosts(CallCosts):
    """A call costs one unit per sequence whatever its rows: every lookup draft pays, at any batch, so the
    regime does not depend on the machine's timing."""

    def observe(self, b, t, seconds):
        pass

    def cost(self, b, t):
        return float(b)


class _AlwaysSpeculate(SpeculationGate):
    """Above batch 1 every iteration looks for drafts, whatever the machine measured."""

    def speculate(self, b):
        return True


def _engine(backend, flat=True, **cfg) -> Engine:
    spec = cfg.pop("speculative", SpecConfig(**LOOKUP))
    eng = Engine(backend, EngineConfig(**{"max_len": 128, **cfg}, speculative=spec))
    if flat:
        eng.call_costs = _FlatCosts()
        eng._spec_gate = _AlwaysSpeculate()
    return eng


def _looping_prompts(n, seed=0):
    """Prompts that repeat a phrase (lookups match from the first step) and random ones (they match only
    once the output loops)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(0, 300, rng.integers(2, 6)).tolist()
        tail = rng.integers(0, 300, rng.integers(1, 8)).tolist()
        out.append(phrase * 3 + tail if i % 2 == 0 else tail + phrase)
    return out


# ------------------------------------------------------------------------------------------ the drafts
def test_lookup_drafts_continue_the_latest_occurrence_of_the_longest_suffix():
    lk = Lookup([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6])
    assert lk.draft(3) == ([7, 1, 2], 2)  # "5 6" last occurred at 5..6: what followed it
    assert lk.predict() == (7, 2)
    lk.push(7)  # "5 6 7" occurred at 5..7 (latest)
    # past the sequence's end the continuation copies itself (the span from the occurrence repeats)
    assert lk.draft(8) == ([1, 2, 5, 6, 7, 1, 2, 5], 3)
    assert lk.draft(4) == ([1, 2, 5, 6], 3)
    assert Lookup([1, 2, 3]).draft(4) == ([], 0)  # the last token is new
    assert Lookup([]).draft(2) == ([], 0) and Lookup([4]).predict() == (-1, 0)
    assert Lookup([3, 3]).draft(4) == ([3, 3, 3, 3], 1)  # a run of one token predicts itself, on and on
    assert Lookup([9, 1, 2, 1, 2]).draft(5) == ([1, 2, 1, 2, 1], 2)  # a loop of two drafts its next turns


def test_call_costs_measure_by_shape_and_extrapolate():
    c = CallCosts()
    assert c.cost(1, 1) == 1.0 and c.cost(1, 4) == pytest.approx(1 + 3 * CallCosts.ROW_GROWTH)
    c.observe(1, 1, 5.0)  # the first call of a shape is not counted (it builds the bindings)
    assert c.cost(1, 1) == 1.0
    c.observe(1, 1, 2.0)
    assert c.cost(1, 1) == 2.0
    assert c.cost(1, 3) == pytest.approx(2.0 * (1 + 2 * CallCosts.ROW_GROWTH))  # the same batch, scaled by rows
    assert c.cost(4, 1) == pytest.approx(2.0 * (1 + 3 * CallCosts.BATCH_GROWTH))
    c.observe(1, 3, 9.0), c.observe(1, 3, 2.4)
    g = CallCosts.ROW_GROWTH  # from the nearest measured shape, by the growth model's ratio
    assert c.cost(1, 3) == 2.4 and c.cost(1, 4) == pytest.approx(2.4 * (1 + 3 * g) / (1 + 2 * g))
    c.observe(1, 3, 100.0)  # an outlier counts at most OUTLIER times the estimate
    assert c.cost(1, 3) == pytest.approx(2.4 + CallCosts.ALPHA * (CallCosts.OUTLIER * 2.4 - 2.4))
    assert set(c.as_dict()) == {"1x1", "1x3"}


def test_call_costs_of_several_rows_follow_the_plain_step_when_the_machine_speeds_up():
    """Rows' calls measured while the machine ran at half speed (this VM ran the same batch-1 work in
    213-400 ms, process to process), then only plain steps at full speed (a row that stops drafting refreshes nothing but the
    plain step): the several-row shapes keep their measured ratio to the plain step, and drafts accepted
    at the measured rate (~0.6) still pay. Kept in seconds, the rows would stay twice as dear and no draft
    length would beat a plain step, so lookup rounds, the only thing that refreshes them, would stop for
    good."""
    c = CallCosts()
    for _ in range(6):  # the slow phase: a plain step 1 ms, k rows 1 ms x (1 + 0.1 (k - 1))
        c.observe(1, 1, 1e-3)
        for k in range(2, 8):
            c.observe(1, k, 1e-3 * (1 + 0.1 * (k - 1)))
    for _ in range(40):  # then twice as fast, plain steps only
        c.observe(1, 1, 0.5e-3)
    assert c.cost(1, 1) == pytest.approx(0.5e-3, rel=1e-3)
    for k in range(2, 8):
        assert c.cost(1, k) / c.cost(1, 1) == pytest.approx(1 + 0.1 * (k - 1))
    probs, plain = np.full(6, 0.6), 1 / c.cost(1, 1)
    assert lookup_length(probs, c, plain)[0] > 0  # a round pays: lookups go on
    expected = np.cumsum(np.concatenate([[1.0], np.cumprod(probs)]))  # E(k), k = 0..6
    stale = max(expected[k] / (1e-3 * (1 + 0.1 * k)) for k in range(1, 7))  # the same rows kept in seconds
    assert stale < plain


def test_call_costs_of_rows_measured_before_any_plain_step_are_kept_in_seconds():
    c = CallCosts()
    c.observe(1, 4, 9.0), c.observe(1, 4, 1.3)  # no plain step measured yet: seconds
    assert c.cost(1, 4) == 1.3 and c.cost(1, 1) == pytest.approx(1.3 / (1 + 3 * CallCosts.ROW_GROWTH))
    c.observe(1, 1, 9.0), c.observe(1, 1, 1.0)
    c.observe(1, 4, 1.25)  # a plain step exists now: the shape is a ratio to it from here on
    assert c.cost(1, 4) == pytest.approx(1.25) and set(c.as_dict()) == {"1x1", "1x4"}
    c.observe(1, 1, 0.5)  # the plain step's estimate moves, and the shape with it
    assert c.cost(1, 4) / c.cost(1, 1) == pytest.approx(1.25)


def test_lookup_acceptance_counts_judged_drafts_only():
    a = LookupAcceptance(4, 6)
    assert a.probs(2, 3).tolist() == [0.5, 0.5, 0.5]  # the prior
    a.record(2, 4, 1)  # draft 1 accepted, draft 2 rejected, drafts 3-4 never judged
    assert a.probs(2, 4).tolist() == [2 / 3, 1 / 3, 0.5, 0.5]
    a.record(2, 2, 2)  # both accepted
    assert a.probs(2, 2).tolist() == [3 / 4, 2 / 4]
    assert a.probs(1, 1).tolist() == [0.5]  # another match length: its own counts


def test_lookup_length_maximises_expected_tokens_per_second():
    costs = CallCosts.__new__(_FlatCosts)  # one unit per call: E(k) grows with k, so all drafts pay
    assert lookup_length(np.array([0.9, 0.9, 0.9]), costs, 1.0) == (3, pytest.approx(1 + 0.9 + 0.81 + 0.729))
    c = CallCosts()  # the priors: a row more costs ROW_GROWTH
    k, v = lookup_length(np.array([0.9, 0.9, 0.05]), c, 1.0)
    assert k == 2 and v == pytest.approx((1 + 0.9 + 0.81) / c.cost(1, 3))  # a third draft adds too little
    assert lookup_length(np.array([0.03, 0.9]), c, 1.0)[0] == 0  # an unlikely first draft: a plain step
    assert lookup_length(np.array([0.9, 0.9]), c, 10.0)[0] == 0  # a plain batched step is cheaper per token


def test_exit_gate_follows_measured_cost_and_retries():
    g = ExitDraftGate()
    assert g.pays(1.0)  # untried
    g.observe(4.0, 2)  # 2 s per token
    assert g.pays(3.0) and not g.pays(1.0)
    assert sum(g.pays(1.0) for _ in range(ExitDraftGate.RETRY * 2)) == 2  # tried again every RETRY rounds


def test_sources_config_errors():
    with pytest.raises(ConfigError, match="speculative.sources must be"):
        SpecConfig(sources=("lookup", "psychic"))
    with pytest.raises(ConfigError, match="sources is empty"):
        SpecConfig(sources=())
    assert EngineConfig(speculative={"sources": ["lookup"]}).speculative.sources == SpecConfig(**LOOKUP).sources


# ------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_lookup_drafts_equal_full_decoding(batch):
    m = _looping()
    prompts = _looping_prompts(12)
    eng = _engine(TorchBackend(m), max_seqs=batch, max_running=batch)
    got = _run(eng, prompts, max_tokens=40, mode=Mode.EXACT)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in _full(m, prompts, 40)]
    st = eng.source_stats["lookup"]
    assert st.rounds > 20 and st.accepted > st.rounds, st.as_dict()
    assert max(n for _, n in st.lengths) >= 4, st.as_dict()  # long accepted runs
    assert st.accepted < st.drafted, st.as_dict()  # and rejections
    assert eng.source_stats["exit"].rounds == 0 and eng.plain_steps > 0  # no match yet: plain steps


def test_no_draft_pays_means_plain_steps_only():
    """Measured costs that make a verified row dear (priors: one row more costs 5 times a step) leave no
    draft worth verifying: every token comes from a plain step, still the full model's."""
    m = _looping()
    prompts = _looping_prompts(4)
    eng = _engine(TorchBackend(m), flat=False)
    eng.call_costs.ROW_GROWTH = 5.0
    got = _run(eng, prompts, max_tokens=20, mode=Mode.EXACT)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in _full(m, prompts, 20)]
    assert eng.spec_stats.rounds == 0 and eng.plain_steps > 0


def test_mixed_batch_and_both_sources():
    """Exact requests beside bounded and full ones, both sources configured: each request gets what its
    mode promises; exit drafts run where no lookup draft does."""
    from tests.unit.edge.runtime.test_speculative import _Agreement

    m = _looping()
    prompts = _looping_prompts(6)
    eng = Engine(TorchBackend(m), EngineConfig(max_len=128, speculate_max_batch=None,
                                               speculative=SpecConfig(stop="fixed", fixed=2)), _Agreement())
    eng.call_costs = _FlatCosts()
    eng._spec_gate = _AlwaysSpeculate()
    modes = [Mode.EXACT, Mode.FULL, Mode.EXACT, Mode.EXACT, Mode.FULL, Mode.EXACT]
    ids = [eng.submit(Request(p, 24, mode=md)) for p, md in zip(prompts, modes)]
    out = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id].append(ev.token)
    assert [out[i] for i in ids] == [[t for t, _ in r] for r in _full(m, prompts, 24)]
    assert eng.source_stats["lookup"].rounds > 0 and eng.source_stats["exit"].rounds > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_bounded_requests_draft_with_bounded_drafts(batch):
    """With ``bounded_drafts`` a request in mode bounded takes lookup drafts like an exact one: with a rule that
    never lets a token leave, its tokens are the full model's and lookup rounds ran; without it, none."""
    from edge.runtime.rules import NeverExit

    m = _looping()
    prompts = _looping_prompts(8)
    for on in (True, False):
        eng = _engine(TorchBackend(m), max_seqs=batch, max_running=batch, bounded_drafts=on)
        eng.rule = NeverExit()
        got = _run(eng, prompts, max_tokens=30, mode=Mode.BOUNDED)
        assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in _full(m, prompts, 30)]
        rounds = eng.source_stats["lookup"].rounds
        assert (rounds > 10) if on else (rounds == 0), (on, eng.source_stats["lookup"].as_dict())
        assert eng.source_stats["exit"].rounds == 0 and eng.plain_steps == 0  # plain_steps: exact requests'


def _teacher_forced(m, prompt, tokens):
    """The full model's greedy token after each prefix prompt + tokens[:i]."""
    with torch.no_grad():
        logits = m.backbone(torch.tensor([list(prompt) + list(tokens[:-1])])).logits[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("batch", [1, 2])
def test_bounded_drafts_beside_exits_owe_nothing(batch):
    """Bounded requests that exit (deferral: their skipped layers owed) and draft: a round never runs while a
    sequence owes deferred rows (its verification would read K/V not yet written), so every token that did
    not leave early is the full model's on its prefix, teacher-forced; and both regimes ran. (Without that guard
    this test fails: checked when it was written.)"""
    from edge.runtime.engine_config import KVMode
    from edge.runtime.rules import ConfidenceRule

    m = _model(seed=2)  # attention at full strength (the looping model's would hide K/V never written)
    prompts = _looping_prompts(6, seed=3)
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=batch, max_running=batch, max_len=128, kv_mode=KVMode.DEFER,
                                               defer_exit_max_batch=None, bounded_drafts=True,
                                               speculative=SpecConfig(**LOOKUP)), ConfidenceRule(0.3))
    eng.call_costs = _FlatCosts()
    eng._spec_gate = _AlwaysSpeculate()
    got = _run(eng, prompts, max_tokens=30, mode=Mode.BOUNDED)
    last = m.backbone.cfg.num_layers
    exits = checked = 0
    for p, seq in zip(prompts, got):
        tokens = [t for t, _ in seq]
        ref = _teacher_forced(m, p, tokens)
        for i, (t, e) in enumerate(seq):
            if e == last:
                assert t == ref[i], (p, i, seq)
                checked += 1
            else:
                exits += 1
    assert exits > 5 and checked > 30 and eng.source_stats["lookup"].rounds > 5, (exits, checked,
                                                                                 eng.source_stats["lookup"].as_dict())


def test_max_tokens_and_stop_ids_inside_an_accepted_run():
    m = _looping()
    prompt = _looping_prompts(1)[0]
    (ref,) = [[t for t, _ in r] for r in _full(m, [prompt], 30)]
    for n in (1, 2, 7, 13):
        (got,) = _run(_engine(TorchBackend(m)), [prompt], max_tokens=n, mode=Mode.EXACT)
        assert [t for t, _ in got] == ref[:n]
    stop = ref[9]
    eng = _engine(TorchBackend(m))
    (got,) = _run(eng, [prompt], max_tokens=30, mode=Mode.EXACT, stop_ids=(stop,))
    assert [t for t, _ in got] == ref[:ref.index(stop) + 1]


def test_a_model_without_exits_speculates_from_lookups():
    from edge.model.exits import ExitConfig, MultiExitModel
    from tests.unit.edge.runtime.test_engine import CFG

    torch.manual_seed(0)
    m = MultiExitModel(_looping().backbone, ExitConfig(layers=[CFG.num_layers], adapter_rank=0)).eval()
    prompts = _looping_prompts(4)
    eng = _engine(TorchBackend(m), speculative=SpecConfig())  # both sources; the model has no exit to draft from
    got = _run(eng, prompts, max_tokens=24, mode=Mode.EXACT)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in _full(m, prompts, 24)]
    assert eng.source_stats["lookup"].rounds > 0 and eng.source_stats["exit"].rounds == 0


def test_a_model_without_exits_has_a_head_without_statistics_on_onnx_runtime(tmp_path):
    """A model with one exit never decides or drafts from an exit: its fused head computes logits and token only
    (the decision statistics cost 9 of the demo head's 63 us at one row: exporters/ort_fused.head_has_stats), and
    its plain steps and lookup rounds on ONNX Runtime decode the torch model's full-depth tokens."""
    import json

    from edge.model.exits import ExitConfig, MultiExitModel
    from tests.unit.edge.runtime.test_engine import CFG
    from tests.unit.edge.runtime.test_ort_backend import _export

    torch.manual_seed(0)
    m = MultiExitModel(copy.deepcopy(_looping()).backbone, ExitConfig(layers=[CFG.num_layers], adapter_rank=0)).eval()
    m, ckpt, graphs = _export(tmp_path, m)
    fused = json.loads((graphs / "graphs.json").read_text())["fused"]["graphs"]
    assert fused["head"]["outputs"] == ["logits", "exit_token"] and "draft_head" not in fused
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert not backend.head_stats
    prompts = _looping_prompts(4)
    want = [[t for t, _ in r] for r in _full(m, prompts, 24)]
    for mode in (Mode.FULL, Mode.EXACT):
        eng = _engine(backend, speculative=SpecConfig())
        got = _run(eng, prompts, max_tokens=24, mode=mode)
        assert [[t for t, _ in r] for r in got] == want, mode
    assert eng.source_stats["lookup"].rounds > 0, "mode exact verified lookup drafts"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tests.unit.edge.runtime.test_ort_backend import _export

    return _export(tmp_path_factory.mktemp("ort_lookup"), copy.deepcopy(_looping()))


@pytest.mark.slow  # ~10 s with the export it alone uses; lookup drafts on torch stay in make test-fast
@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_drafts_on_onnx_runtime_equal_its_full_depth(exported, batch):
    """On ONNX Runtime the verification is one call of the graph of every layer with the newest token and
    the drafts; the reference is mode full on the same backend (the same graph, one row a call)."""
    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    prompts = _looping_prompts(8, seed=1)
    eng = _engine(backend, max_seqs=batch, max_running=batch)
    got = _run(eng, prompts, max_tokens=32, mode=Mode.EXACT)
    ref = _run(Engine(backend, EngineConfig(max_len=128, max_seqs=batch, max_running=batch)), prompts,
               max_tokens=32, mode=Mode.FULL)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in ref]
    st = eng.source_stats["lookup"]
    assert st.rounds > 10 and st.accepted > st.rounds, st.as_dict()


# ------------------------------------------------------------------------------------------ sampling
LOOP_PROMPT = PROMPT * 3  # lookups match after the first token whenever it is one of the prompt's


def _sample_lookup_joint(m, temperature, top_p, requests=640):
    """Counts [V, V, V] of the first TOKENS tokens after LOOP_PROMPT, mode exact with lookup drafts, every
    draft verified (flat costs), 64 sequences at once. Returns (counts, the lookup source's SpecStats)."""
    eng = _engine(TorchBackend(m), max_seqs=64, max_running=64, max_len=16, prefill_budget=64 * 9,
                  speculative=SpecConfig(max_draft=3, **LOOKUP))
    return _engine_joint(eng, LOOP_PROMPT, temperature, top_p, requests), eng.source_stats["lookup"]


@functools.lru_cache(maxsize=None)
def _loop_joint(temperature, top_p):
    return _exact_joint(_sampling_model(), temperature, top_p, LOOP_PROMPT)


@pytest.mark.slow  # ~7 s each (hundreds of sampled requests); the negative control stays in make test-fast
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)], ids=["softmax", "t0.7_top_p0.8"])
def test_lookup_sampling_is_distributed_as_the_full_model(temperature, top_p):
    """A lookup draft is a point mass (q(x) = 1): accepted with probability p(x), else the token is drawn
    from p without x. Chi-square of the first three tokens' joint against the full model's exact joint."""
    counts, st = _sample_lookup_joint(_sampling_model(), temperature, top_p)
    pvalue = _chisquare(counts, _loop_joint(temperature, top_p))
    assert pvalue > ALPHA, f"p = {pvalue:.3g}"
    assert st.rounds > 100 and 0.05 * st.drafted < st.accepted < 0.95 * st.drafted, st.as_dict()


def _keep_every_draft(drafts, q, p, rng):
    return len(drafts), int(rng.choice(p[-1].shape[0], p=p[-1]))


def test_the_lookup_distribution_test_rejects_a_wrong_acceptance_rule(monkeypatch):
    """Negative control: keeping every lookup draft fails the same test by far."""
    monkeypatch.setattr(rounds_module, "accept_sampled", _keep_every_draft)
    counts, st = _sample_lookup_joint(_sampling_model(), 1.0, 1.0, requests=192)
    assert st.accepted == st.drafted > 0
    assert _chisquare(counts, _loop_joint(1.0, 1.0)) < ALPHA


# ------------------------------------------------------------------------------------------ corpus drafts
def test_ngram_table_keeps_frequent_successors_and_chains_them():
    from edge.model.ngram import NgramTable, build_table

    seqs = [np.array([1, 2, 3, 4, 5] * 3), np.array([1, 2, 3, 9]), np.array([7, 8, 6])]
    arrays = build_table(seqs, vocab=10, min_count=2, min_share=0.5)
    t = NgramTable(arrays, min_n=2)
    assert t.draft([0, 1, 2], 4) == ([3, 4, 5, 1], 2)  # "1 2" -> 3 (4 of 4), then "2 3" -> 4 (3 of 4), ...
    assert t.draft([7, 8], 3) == ([], 0)  # "7 8" seen once: below min_count
    assert t.draft([5], 2) == ([], 0)  # one token is below min_n
    assert NgramTable(arrays, min_n=1).draft([5], 2) == ([1, 2], 1)
    shared = build_table([np.array([1, 2, 3, 1, 2, 4, 1, 2, 6])], vocab=10, min_count=2, min_share=0.5)
    assert NgramTable(shared).draft([1, 2], 1) == ([], 0)  # "1 2" -> 3, 4, 6: no successor has half
    assert len(NgramTable(shared, min_n=1)) == 1  # only "1" -> 2 (3 of 3) survives


def test_a_broken_ngram_table_is_a_clear_error(tmp_path):
    from edge.model.ngram import NgramTable

    bad = tmp_path / "ngram.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="is not an n-gram table"):
        NgramTable.load(bad)
    np.savez(bad, format=np.array(99), vocab=np.array(10))
    with pytest.raises(ConfigError, match="format 99"):
        NgramTable.load(bad)


def test_corpus_drafts_equal_full_decoding_and_are_chosen_when_they_pay():
    """A table of the model's own full-depth continuations of *other* prompts (the training role): its
    drafts are accepted often, the engine drafts from it where the context has no match, and the output
    is the full model's."""
    from edge.model.ngram import NgramTable, build_table

    m = _looping()
    train = _looping_prompts(16, seed=7)
    text = [np.array(p + [t for t, _ in r]) for p, r in zip(train, _full(m, train, 40))]
    table = NgramTable(build_table(text, vocab=300, min_count=1, min_share=0.5))
    backend = TorchBackend(m)
    backend.ngram_table = table
    prompts = _looping_prompts(8, seed=3)
    eng = _engine(backend, speculative=SpecConfig(sources=("lookup", "corpus")))
    got = _run(eng, prompts, max_tokens=32, mode=Mode.EXACT)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in _full(m, prompts, 32)]
    st = eng.source_stats["corpus"]
    assert st.rounds > 5 and st.accepted > 0, st.as_dict()


def test_the_export_builds_the_table_from_the_training_split_only(monkeypatch, tmp_path):
    """Data roles: corpus drafts come from the training split, the text and the windows the model continues
    alike; a table built from the calibration or test split would draft the very text the benchmarks
    measure on. Where the model's continuation and the text disagree, the table drafts the model's."""
    import edge.pipeline.export as export
    from edge.core.data import Document, Split
    from edge.model.ngram import NgramTable

    asked = []
    train_text = "def f(x):\n    return x\n" * 40

    def fake_split(split):
        asked.append(Split(split))
        return [Document("a.py", train_text)]

    class _Tok:
        def encode_batch(self, texts):
            class E:
                def __init__(self, t):
                    self.ids = [ord(c) % 50 for c in t]
            return [E(t) for t in texts]

        def get_vocab_size(self):
            return 50

    monkeypatch.setattr(export, "load_split", fake_split)
    counts = export.write_ngram_table(_Tok(), tmp_path, 2, 0.5)
    assert asked == [Split.TRAIN] and counts["keys_3"] > 0 and "keys_4" not in counts and counts["model_windows"] == 0
    assert len(NgramTable.load(tmp_path / "ngram.npz")) == sum(v for k, v in counts.items() if k.startswith("keys_"))

    ids = [ord(c) % 50 for c in train_text]
    given = []

    def continue_with(prompts, n):  # "the model": always writes 49 after whatever it was given
        given.extend(prompts)
        return [[49] * n for _ in prompts]

    asked.clear()
    counts = export.write_ngram_table(_Tok(), tmp_path, 2, 0.5, continue_with, windows=6, window_tokens=16,
                                      new_tokens=8, seed=0)
    assert asked == [Split.TRAIN] and counts["model_windows"] == len(given) == 6
    starts = [next(i for i in range(len(ids)) if ids[i:i + 16] == p) for p in given]
    assert all(len(p) == 16 for p in given) and len(set(starts)) == 6  # distinct windows of the training text
    table = NgramTable.load(tmp_path / "ngram.npz")
    assert table.order == 4
    assert table.draft([49, 49, 49], 3) == ([49, 49, 49], 3)  # the model's own n-grams
    tail = ids[starts[0] + 12:starts[0] + 16]  # a window's last tokens: the model wrote 49 after them
    assert table.draft(tail, 1)[0] == [49]  # over the text's successor there (merge order: the next test)
    # the text part computed beforehand (the export's thread, export.text_ngrams) gives the same table
    given.clear()
    text = export.text_ngrams(_Tok(), 2, 0.5)
    (tmp_path / "again").mkdir()
    again = export.write_ngram_table(_Tok(), tmp_path / "again", 2, 0.5, continue_with, windows=6, window_tokens=16,
                                     new_tokens=8, seed=0, text=text)
    assert again == counts and len(given) == 6
    with np.load(tmp_path / "ngram.npz") as a, np.load(tmp_path / "again" / "ngram.npz") as b:
        assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


def test_a_share_of_the_training_documents_gives_the_text_and_the_windows_alike(monkeypatch, tmp_path):
    """``text_share``: the table's text n-grams and the windows the model continues both come from one seeded
    draw of that share of the training documents (never another split), the same draw for the same seed."""
    import edge.pipeline.export as export
    from edge.core.data import Document, Split
    from edge.model.ngram import NgramTable

    asked, encoded = [], []
    docs = [Document(f"d{i}.py", chr(ord("a") + i) * 60) for i in range(8)]  # document i: one token, i

    def fake_split(split):
        asked.append(Split(split))
        return docs

    class _Tok:
        def encode_batch(self, texts):
            encoded.append(list(texts))

            class E:
                def __init__(self, t):
                    self.ids = [ord(c) - ord("a") for c in t]
            return [E(t) for t in texts]

        def get_vocab_size(self):
            return 50

    monkeypatch.setattr(export, "load_split", fake_split)
    given = []

    def continue_with(prompts, n):
        given.extend(prompts)
        return [[49] * n for _ in prompts]

    def build(seed):
        encoded.clear()
        given.clear()
        export.write_ngram_table(_Tok(), tmp_path, 2, 0.5, continue_with, windows=4, window_tokens=8, new_tokens=4,
                                 seed=seed, text_share=0.5)
        return sorted({ord(t[0]) - ord("a") for t in encoded[0]}), sorted({p[0] for p in given})

    kept, continued = build(0)
    assert set(asked) == {Split.TRAIN} and len(encoded) == 1 and len(kept) == 4  # half of 8 documents, encoded once
    assert set(continued) <= set(kept)  # the windows the model continued are of the drawn documents
    table = NgramTable.load(tmp_path / "ngram.npz")
    left_out = next(i for i in range(8) if i not in kept)
    assert table.draft([left_out] * 3, 1) == ([], 0)  # a document left out of the draw is not in the text's n-grams
    assert build(0) == (kept, continued) and build(1)[0] != kept  # seeded
    with pytest.raises(ConfigError, match="ngram_text_share"):
        export.ExportStageConfig(ngram_text_share=0.0)


def test_ngram_tables_merge_and_a_large_vocabulary_gets_a_lower_order():
    from edge.model.ngram import MAX_N, NgramTable, build_table, merge_tables, order_for

    own = build_table([np.array([1, 2, 3, 7, 7])], vocab=10, min_count=1)
    text = build_table([np.array([1, 2, 3, 4] * 3 + [5, 6, 8] * 3)], vocab=10, min_count=1)
    merged = NgramTable(merge_tables(own, text), min_n=2)
    assert merged.draft([1, 2], 2) == ([3, 7], 2)  # "1 2" -> 3 both; "2 3" -> 7 (own) over 4 (text)
    assert merged.draft([5, 6], 1) == ([8], 2)  # only the text knows "5 6"
    assert order_for(10) == MAX_N == 4 and order_for(32_000) == 3 and order_for(128_256) == 2
    big = build_table([np.array([1, 2, 3, 1, 2, 3])], vocab=128_256, min_count=1)
    assert NgramTable(big).order == 2 and "keys_3" not in big
    assert NgramTable(big).draft([1, 2], 2) == ([3, 1], 2)
    old = {k: v for k, v in text.items() if k not in ("keys_4", "next_4")}  # a table written with n <= 3
    assert NgramTable(old).order == 3 and NgramTable(old).draft([4, 1, 2], 1) == ([3], 3)
    with pytest.raises(ConfigError, match="vocabularies"):
        merge_tables(own, big)
