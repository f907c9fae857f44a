"""The candidate-set exit decision: the context lookup, the host reference of a check, and the engine
deciding over a shortlist on torch and on the fused ONNX Runtime graphs (same tokens, same exit layers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge.core.errors import ConfigError
from edge.model.exits import ExitConfig, MultiExitModel, choose_shortlist
from edge.model.reference import reference_generate
from edge.runtime.backend import make_backend
from edge.model.candidates import (CANDIDATE_SIGNAL_NAMES, NUM_NAMED, check, is_signal_names, lookup_feature,
                                   num_features, signal_names)
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.model.lookup import MAX_N, NONE, Lookup, lookup_along
from edge.runtime.rules import ConfidenceRule, NeverExit, ScoreForm
from edge.runtime.torch_backend import TorchBackend
from edge.model.decoder import Decoder
from tests.tolerance import assert_f32_close
from tests.unit.edge.runtime.test_engine import CFG, _prompts, _run
from tests.unit.edge.runtime.test_ort_backend import _export

K = 24


def _model(seed=0, layers=(1, 2, 3, 4, 6)) -> MultiExitModel:
    torch.manual_seed(seed)
    dec = Decoder(CFG)
    dec.init_weights(seed, std=0.3)
    m = MultiExitModel(dec.eval(), ExitConfig(layers=list(layers), adapter_rank=4, shortlist=K)).eval()
    with torch.no_grad():
        for p in m.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape))
        # a shortlist that holds the tokens these random weights like best, so that checks agree sometimes
        counts = m.backbone.head_weight.norm(dim=1)
        m.shortlist.copy_(torch.argsort(-counts)[:K])
    return m


# ------------------------------------------------------------------ lookup
def _brute(tokens: list[int]) -> tuple[int, int]:
    """The longest suffix (n <= MAX_N) that occurred earlier, and what followed its latest occurrence."""
    for n in range(min(MAX_N, len(tokens)), 0, -1):
        suf = tokens[len(tokens) - n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suf:
                return tokens[s + n], n
    return NONE, 0


def test_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(50):
        seq = rng.integers(0, 5, rng.integers(1, 40)).tolist()  # a small alphabet: many repeats
        lk = Lookup()
        for i, t in enumerate(seq):
            lk.push(t)
            assert lk.predict() == _brute(seq[:i + 1]), seq[:i + 1]


def test_a_lookup_asked_after_several_pushes_answers_as_one_asked_after_each():
    """The index is built when asked (Lookup._catch_up): runs of pushes with no question between them,
    then a prediction or a draft, give what the brute force gives on the whole sequence."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        seq = rng.integers(0, 5, rng.integers(1, 60)).tolist()
        lk, eager = Lookup(seq[:rng.integers(0, 8)]), Lookup()
        for t in lk.tokens:
            eager.push(t)
            eager.predict()
        i = len(lk.tokens)
        while i < len(seq):
            step = int(rng.integers(1, 6))
            for t in seq[i:i + step]:
                lk.push(t)
                eager.push(t)
                eager.predict()
            i = min(i + step, len(seq))
            assert lk.predict() == _brute(seq[:i]), seq[:i]
            assert lk.draft(5) == eager.draft(5)


def test_lookup_examples():
    lk = Lookup([1, 2, 3, 9, 1, 2])
    assert lk.predict() == (3, 2)  # "1 2" was followed by 3
    lk.push(7)
    assert lk.predict() == (NONE, 0)  # 7 is new
    assert Lookup().predict() == (NONE, 0)
    toks, lens = lookup_along(np.array([1, 2, 3, 9, 1, 2, 3]), 4, 7)
    assert toks.tolist() == [2, 3, 9] and lens.tolist() == [1, 2, 3]


# ------------------------------------------------------------------ the check
def test_check_features_by_hand():
    z = np.array([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]], np.float32)
    ids = np.array([7, 8, 9])
    hidden = np.array([[0.5, -1.0, 2.0, 0.0], [1.5, 0.25, -3.0, 1.0]], np.float32)  # D = 4
    c = check(z, ids, np.array([8, 3]), lookup_feature(np.array([2, 0])), None, None, hidden)
    assert c.tokens.tolist() == [[7, 8], [9, 7]] and c.token.tolist() == [7, 9]  # ties: the lower index first
    assert c.features.shape == (2, num_features(4)) == (2, len(signal_names(4))) == (2, len(CANDIDATE_SIGNAL_NAMES) + 4)
    assert np.array_equal(c.features[:, NUM_NAMED:], hidden), "the exit hidden follows the named features"
    assert c.features[:, :2].tolist() == [[2.0, 1.0], [5.0, 0.0]] and np.array_equal(c.logits, c.features[:, :2])
    assert c.features[:, 2:4].tolist() == [[0.0, 1.0], [0.0, 0.0]]  # the lookup is row 0's second candidate
    assert c.features[:, 4].tolist() == [2 / MAX_N, 0.0]
    assert not c.features[:, 5:NUM_NAMED].any()  # first check: no previous
    z2 = np.array([[2.0, 0.0, 1.0], [0.0, 0.0, 5.0]], np.float32)  # row 0's second candidate changed
    nxt = check(z2, ids, np.array([-1, -1]), np.zeros(2), c.tokens, c.logits, hidden)
    assert nxt.tokens.tolist() == [[7, 9], [9, 7]]
    assert nxt.features[:, 5:7].tolist() == [[1.0, 0.0], [1.0, 1.0]]  # agreement with the previous check, per rank
    assert np.array_equal(nxt.features[:, 7:NUM_NAMED], c.logits)


def test_signal_names_carry_the_hidden_size():
    assert signal_names(3) == CANDIDATE_SIGNAL_NAMES + ("exit_hidden_0", "exit_hidden_1", "exit_hidden_2")
    assert is_signal_names(signal_names(64)) and not is_signal_names(CANDIDATE_SIGNAL_NAMES)
    assert not is_signal_names(signal_names(3)[:-2] + ("exit_hidden_2",))


def test_score_form_of_a_linear_score_is_that_score():
    """relu(a) - relu(-a) = a: the two-unit MLP is the linear score up to the product's summation order."""
    rng = np.random.default_rng(1)
    n = num_features(CFG.hidden_size)
    w, b = rng.standard_normal(n).astype(np.float32), 0.3
    f = rng.standard_normal((50, n)).astype(np.float32)
    assert_f32_close(ScoreForm.linear(w, b)(f), f @ w + np.float32(b), n, 1, "linear score")


def test_choose_shortlist_is_by_frequency():
    ids = choose_shortlist(np.array([5, 5, 5, 2, 2, 9, 1, 1]), 3, vocab_size=10)
    assert ids.tolist() == [5, 1, 2]  # ties: the lower id first


def test_shortlist_and_gates_are_exclusive():
    with pytest.raises(ConfigError, match="choose one"):
        ExitConfig(layers=[2, 4], shortlist=8, gate_hidden=4)


# ------------------------------------------------------------------ the engine
def test_never_exit_gives_full_depth_greedy():
    m = _model()
    for p in _prompts(2, seed=3):
        got = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128), NeverExit()), [p])[0]
        ref = reference_generate(m, p, 12)
        assert [t for t, _ in got] == ref.tokens and all(e == 6 for _, e in got)


def _mixed_threshold(m, prompts, cfg) -> float:
    """A threshold on the top candidate logit (feature 0, what ConfidenceRule thresholds for a shortlist
    model) at which some tokens leave early and others run to full depth."""
    for t in np.linspace(8.0, -2.0, 41):
        out = _run(Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(float(t))), prompts, max_tokens=16)
        exits = [e for seq in out for _, e in seq]
        if 0.2 <= np.mean([e < m.num_layers for e in exits]) <= 0.7:
            return float(t)
    raise AssertionError("no threshold gives both early exits and full depth")


def test_exits_emit_shortlist_tokens_and_checks_see_the_lookup():
    m = _model()
    cfg = dict(max_seqs=4, max_running=4, max_len=128)
    thr = _mixed_threshold(m, _prompts(4, seed=4), cfg)
    eng = Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(thr))
    out = _run(eng, _prompts(4, seed=4), max_tokens=16)
    early = [t for seq in out for t, e in seq if e < 6]
    assert early, "some tokens must exit early for the test to mean anything"
    assert set(early) <= set(m.shortlist.tolist())


def test_engine_matches_the_reference_generator():
    """One sequence at a time, K/V of skipped layers by propagation (the reference's): the engine's checks
    and the reference generator's decide the same tokens at the same layers."""
    m = _model()
    prompts = [p + p[:5] for p in _prompts(3, seed=6)]
    thr = _mixed_threshold(m, prompts, dict(max_seqs=1, max_len=128))
    for p in prompts:
        got = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=1, max_len=128), ConfidenceRule(thr)), [p])[0]
        ref = reference_generate(m, p, 12, rule=ConfidenceRule(thr))
        assert [t for t, _ in got] == ref.tokens and [e for _, e in got] == ref.exit_layers


def test_sampled_requests_never_exit_over_a_shortlist():
    m = _model()
    eng = Engine(TorchBackend(m), EngineConfig(max_seqs=2, max_running=2, max_len=128), ConfidenceRule(-1e9))
    out = _run(eng, _prompts(2, seed=5), max_tokens=8, temperature=0.8, seed=1)
    assert all(e == 6 for seq in out for _, e in seq)


def test_a_rule_without_a_score_is_refused():
    class HostOnly:
        def decide(self, layer, stats, tokens, hidden):
            return np.zeros(tokens[layer].shape[0], bool)

    with pytest.raises(ConfigError, match="decides in its graphs"):
        Engine(TorchBackend(_model()), EngineConfig(max_seqs=1, max_len=64), HostOnly())


class _MlpRule:
    """A rule whose checks score a fixed random MLP (seeded): exits at every check and full depth both occur."""

    def __init__(self) -> None:
        rng = np.random.default_rng(2)
        self.mlp = ScoreForm(rng.standard_normal((num_features(CFG.hidden_size), 5)).astype(np.float32),
                             rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32), -0.5)

    def score_form(self, layer, f):
        return self.mlp


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("cand"), _model(seed=7))


@pytest.mark.parametrize("mode", list(KVMode))
def test_onnxruntime_decides_as_torch(exported, mode):
    """The fused graphs' checks (candidate logits, features, MLP score in the graph) give the torch
    reference's tokens and exit layers, through scattered slots and both K/V modes."""
    m, ckpt, graphs = exported
    prompts = [p + p[:6] for p in _prompts(4, seed=8)]  # repeats: the lookup finds matches
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=mode, defer_exit_max_batch=None)
    for rule in (ConfidenceRule(_mixed_threshold(m, prompts, cfg)), _MlpRule()):
        ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), rule), prompts, max_tokens=16)
        layers = {e for seq in ref for _, e in seq}
        assert layers & {1, 2, 3, 4} and 6 in layers, f"exits and full depth must both occur ({layers})"
        # the fused graphs check in the graph; the portable ones (what TensorRT builds) on the host, from the
        # export's shortlist_rows.npy
        for name in ("onnxruntime", "onnxruntime_portable"):
            backend = make_backend(name, graphs_dir=graphs, checkpoint=ckpt, threads=1)
            assert _run(Engine(backend, EngineConfig(**cfg), rule), prompts, max_tokens=16) == ref, name


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A shortlist model with a W8A8 head (and layers), activations calibrated, exported to fused graphs."""
    from edge.compress.apply import calibrate_activations, observe, quantize_head, quantize_layers
    from edge.compress.quant import QuantSpec

    m = _model(seed=7)
    for p in m.backbone.parameters():  # the checkpoint's fp16 values first: _export's rounding then changes
        p.data = p.data.half().float()  # nothing the quantized linears cached from the weights
    quantize_layers(m, {j: QuantSpec() for j in range(CFG.num_layers)})
    quantize_head(m, QuantSpec())
    observe(m, [torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))])
    calibrate_activations(m)
    assert m.shortlist_act_scale() is not None
    return _export(tmp_path_factory.mktemp("cand_q"), m)


def test_a_w8a8_head_scores_its_candidates_with_its_own_product(quantized):
    """With a W8A8 head the check's candidate logits are that head's logits on the shortlist rows (input
    quantized with its activation scale): on the host (shortlist_logits) as the torch head computes them, and
    in the fused graphs as an integer product over int8 rows, no float copy of the rows (a quarter of the
    bytes: docs/runtime.md). The fused graphs' engine gives the tokens and exit layers of the portable graphs'
    (the host check, with the scale the export recorded)."""
    import json

    import onnx

    from edge.model.candidates import shortlist_logits

    m, ckpt, graphs = quantized
    hidden = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = m.backbone.head_q(hidden)[:, m.shortlist].numpy()
    got = shortlist_logits(hidden.numpy(), m.shortlist_rows().numpy(), m.shortlist_act_scale())
    assert_f32_close(got, want, CFG.hidden_size, what="candidate logits vs the torch head")
    m.backbone.head_q.enabled = False  # a head switched to float (sensitivity analysis) computes without it
    try:
        assert m.shortlist_act_scale() is None
    finally:
        m.backbone.head_q.enabled = True
    from edge.runtime.static_backend import StaticTorchBackend

    static = StaticTorchBackend(m, device="cpu", graphs=False)  # torch_static: the product on its device
    with torch.no_grad():
        on_device = static._ehz(hidden)[:, CFG.hidden_size:].numpy()
    assert_f32_close(on_device, got, CFG.hidden_size, what="torch_static's candidate logits vs the host's")
    # without the input's quantization the logits differ by more than float rounding: the scale is used
    assert np.abs(shortlist_logits(hidden.numpy(), m.shortlist_rows().numpy()) - want).max() > 1e-3 * np.abs(want).max()
    meta = json.loads((graphs / "graphs.json").read_text())
    assert meta["model"]["shortlist_rows"]["act_scale"] == pytest.approx(m.shortlist_act_scale())
    g = onnx.load(str(graphs / meta["fused"]["graphs"]["segment_0"]["file"]))
    inits = {t.name: t for t in g.graph.initializer}
    assert "sl.rows_t" not in inits and inits["sl.w_i8"].data_type == onnx.TensorProto.INT8
    assert "sl.a_scale" in inits  # the input quantized as the head quantizes its own
    prompts = [p + p[:6] for p in _prompts(4, seed=8)]
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=KVMode.DEFER,
               defer_exit_max_batch=None)
    rule = _MlpRule()
    # the integer layers round differently in torch's fake quantization and ONNX Runtime's kernels (near ties
    # flip a full-depth token: tests/unit/calibration/test_freerun.py judges such an engine against itself), so
    # the fused graphs' in-graph checks are held to the portable graphs' host checks: the same layers' kernels
    portable = make_backend("onnxruntime_portable", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert portable.shortlist_act_scale == pytest.approx(m.shortlist_act_scale())  # recorded by the export
    ref = _run(Engine(portable, EngineConfig(**cfg), rule), prompts, max_tokens=16)
    layers = {e for seq in ref for _, e in seq}
    assert layers & {1, 2, 3, 4} and 6 in layers, f"exits and full depth must both occur ({layers})"
    fused = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert _run(Engine(fused, EngineConfig(**cfg), rule), prompts, max_tokens=16) == ref


def test_inline_deferral_gives_deferrals_tokens_without_its_catch_up(exported):
    """EngineConfig.defer_inline, free-running calibration's engine: a leaving row's skipped layers computed in
    the same step give deferral's tokens and exit layers (batch 4, rows leaving at every check, the shortlist
    checks and an MLP score as calibration ships them), with no catch-up call over scattered slots."""
    m, ckpt, graphs = exported
    prompts = [p + p[:6] for p in _prompts(4, seed=8)]
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=KVMode.DEFER,
               defer_exit_max_batch=None)
    deferred = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    ref = _run(Engine(deferred, EngineConfig(**cfg), _MlpRule()), prompts, max_tokens=16)
    inline = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    got = _run(Engine(inline, EngineConfig(**cfg, defer_inline=True), _MlpRule()), prompts, max_tokens=16)
    assert got == ref
    layers = {e for seq in got for _, e in seq}
    assert layers & {1, 2, 3, 4} and 6 in layers, f"exits and full depth must both occur ({layers})"
    assert inline.gathered_rows == 0  # every step over the whole block of slots: nothing gathered


def test_full_graph_equals_the_segments(exported):
    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert backend._full is not None
    prompts = _prompts(3, seed=9)
    cfg = EngineConfig(max_seqs=3, max_running=3, max_len=128, kv_mode=KVMode.DEFER, defer_exit_max_batch=1)
    # all three decode together from the first step: batch 3 > 1, so no row may exit and the full graph runs
    got = _run(Engine(backend, cfg, ConfidenceRule(-1e9)), prompts, max_tokens=10)
    ref = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=128)), prompts, max_tokens=10)
    assert got == ref
    assert any(key[0] == "full" and key[2] == 3 for key in backend._plans), "the batch-3 steps ran the full graph"


def test_a_shortlist_models_head_computes_no_statistics(exported):
    """A candidate-shortlist model's checks decide in its segment graphs and its ``head`` serves full-depth calls,
    which read logits and token: the fused head has no decision statistics (they cost 9 of its 63 us at one row
    and 119 of 307 at sixteen on the demo model: docs/runtime.md). Its logits and token are the statistics head's
    (the first index of the largest logit, ties included); the draft head keeps the statistics a draft exit's stop
    rule reads, and mode exact drafting from an exit (through that head) decodes full depth's tokens."""
    import json

    import onnxruntime as ort

    from edge.runtime.ortsession import session_options
    from edge.runtime.speculative import SpecConfig
    from exporters.ort_fused import stats_head

    m, ckpt, graphs = exported
    meta = json.loads((graphs / "graphs.json").read_text())["fused"]["graphs"]
    assert meta["head"]["outputs"] == ["logits", "exit_token"]
    assert meta["draft_head"]["outputs"] == ["logits", "exit_stats", "exit_token"]
    so = session_options(ort)  # the process's shared pool
    lean = ort.InferenceSession(str(graphs / meta["head"]["file"]), so, providers=["CPUExecutionProvider"])
    full = ort.InferenceSession(stats_head(m).proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    h = np.random.default_rng(4).standard_normal((16, CFG.hidden_size)).astype(np.float32)
    h[:2] = 0.0  # every logit 0: a tie over the whole vocabulary
    logits, token = lean.run(["logits", "exit_token"], {"exit_hidden": h})
    want_logits, stats, want = full.run(["logits", "exit_stats", "exit_token"], {"exit_hidden": h})
    assert np.array_equal(logits, want_logits) and np.array_equal(token, want) and token[:2].tolist() == [0, 0]
    assert np.array_equal(token[2:], logits[2:].argmax(-1)) and stats.shape == (16, 3)
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert not backend.head_stats
    prompts = _prompts(3, seed=9)
    cfg = dict(max_seqs=1, max_len=128)
    ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg)), prompts, max_tokens=12, mode="full")
    eng = Engine(backend, EngineConfig(**cfg, speculative=SpecConfig(sources=("exit",), stop="fixed", fixed=3)))
    assert [_run(eng, [p], max_tokens=12, mode="exact")[0] for p in prompts] == ref
    assert eng.spec_stats.drafted > 0 and backend._draft_head_sess is not None, "the exit drafted, with the draft head"


def test_without_the_full_graph_a_step_runs_the_chained_segments(tmp_path):
    """``export.full_graph: false``: a decode step in which no row may leave runs the checked segments back to back
    on the step's chained buffers (``decode_until_exit``, no row allowed), not segment call by segment call, with
    the tokens of full depth."""
    m, ckpt, graphs = _export(tmp_path, _model(seed=7), full_graph=False, verify_batches=[])
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert backend._full is None
    one_row_calls = []
    segment = backend.segment
    backend.segment = lambda i, x, *a, **k: (one_row_calls.append(i) if x.shape[1] == 1 else None) or segment(i, x, *a, **k)
    prompts = _prompts(3, seed=9)
    cfg = dict(max_seqs=3, max_running=3, max_len=128, kv_mode=KVMode.DEFER, defer_exit_max_batch=1)
    # all three decode together: batch 3 > 1, so no row may exit and each step runs every layer
    got = _run(Engine(backend, EngineConfig(**cfg), ConfidenceRule(-1e9)), prompts, max_tokens=10)
    ref = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=128)), prompts, max_tokens=10)
    assert got == ref
    assert backend._step_plans and not one_row_calls, "decode steps ran on the chained plans, no segment call alone"


def test_generate_stage_holds_a_shortlist_model_to_its_calibrated_table():
    """A fixed probability threshold means nothing for checks that score raw candidate logits: the generate
    stage refuses a shortlist model in an uncalibrated run, and keeps the fixed rule for other models."""
    from types import SimpleNamespace

    from edge.pipeline.generate import GenerateConfig, _early_rule

    uncalibrated = SimpleNamespace(data={"stages": {}})
    with pytest.raises(ConfigError, match="run `smartexit calibrate` first"):
        _early_rule(GenerateConfig(), uncalibrated, None, _model())
    plain = MultiExitModel(_model().backbone, ExitConfig(layers=[2, 6], adapter_rank=0))
    rule, name = _early_rule(GenerateConfig(threshold=0.8), uncalibrated, None, plain)
    assert name == "fixed" and isinstance(rule, ConfidenceRule) and rule.threshold == 0.8


def test_a_check_is_eleven_graph_nodes():
    """At batch 1 an ONNX Runtime node costs a few microseconds whatever it computes: the check's price is
    its node count (docs/runtime.md), so a node added to it should be a decision, not an accident."""
    from edge.model.segments import segment_layers
    from exporters.ort_fused import build_fused

    m = _model(layers=(2, 6))
    plain = MultiExitModel(m.backbone, ExitConfig(layers=[2, 6], adapter_rank=4)).eval()
    plain.heads.load_state_dict(m.heads.state_dict())

    def nodes(model):
        g = next(g for g in build_fused(model, segment_layers(model.exit_layers), full=False) if g.name == "segment_0")
        return len(g.proto.graph.node)

    # the plain model's decision segment ends at its exit hidden and decides in the head graph
    assert nodes(m) - nodes(plain) == 11
