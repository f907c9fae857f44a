"""Free-running evaluation: every generated token checked against the full model on the same prefix."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calibration.collect import Collected
from edge.core.errors import ConfigError
from edge.model.config import ModelConfig
from edge.model.decoder import Decoder
from edge.model.exits import ExitConfig, MultiExitModel
from edge.model.reference import reference_generate
from calibration.freerun import FreeRun, Served, check_continuations, free_run
from edge.runtime.engine_config import KVMode
from edge.runtime.rules import NeverExit


def _hand_run() -> FreeRun:
    """2 prompts of 2 tokens, 3 generated each (the first from the prefill, not judged), 3 layers.

    unit 0: generated 20 21 22, decided at layers 3 1 3; the full model says 21 then 99 on those prefixes:
            21 exited early and is right, 22 ran full depth and is wrong (a full-depth mismatch).
    unit 1: generated 30 31 32, decided at layers 3 2 1; the full model says 77 then 32:
            31 exited early and is wrong (a false exit), 32 exited early and is right.
    """
    seqs = np.array([[10, 11, 20, 21, 22], [12, 13, 30, 31, 32]])
    exit_layers = np.array([[3, 1, 3], [3, 2, 1]])
    full = np.array([21, 99, 77, 32])  # the full model's token at each judged position, unit by unit
    argmax = {1: np.zeros(4, np.int64), 2: np.zeros(4, np.int64), 3: full}
    data = Collected([1, 2, 3], {k: np.zeros((4, 6)) for k in argmax}, argmax, np.zeros(4, np.int64),
                     np.array([0, 0, 1, 1]), 2)
    return FreeRun(KVMode.PROPAGATE, 3, seqs, exit_layers, data)


def test_wrong_tokens_hand_computed():
    run = _hand_run()
    fe, mm = run.wrong()
    assert fe.tolist() == [[False, False], [True, False]]
    assert mm.tolist() == [[False, True], [False, False]]
    assert run.unit_losses().tolist() == [0.5, 0.5]


def test_summary_hand_computed():
    s = _hand_run().summary()
    assert (s.prompts, s.tokens, s.false_exits, s.full_depth_mismatches) == (2, 4, 1, 1)
    assert s.false_exit_rate == 0.5 and s.exited_frac == 0.75  # judged exits 1, 3, 2, 1
    assert s.mean_exit_layer == pytest.approx(7 / 4)
    assert s.layers_skipped_frac == pytest.approx((2 + 0 + 1 + 2) / 3 / 4)
    assert s.kv_mode == "propagate"


def test_concat_keeps_units_in_order():
    a, b = _hand_run(), _hand_run()
    both = FreeRun.concat([a, b])
    assert both.seqs.shape == (4, 5) and both.data.n_units == 4
    assert both.data.unit.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert both.unit_losses().tolist() == [0.5, 0.5, 0.5, 0.5]


CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=48,
                  max_position_embeddings=64)


def _model() -> MultiExitModel:
    torch.manual_seed(0)
    dec = Decoder(CFG)
    dec.init_weights(0, std=0.3)
    return MultiExitModel(dec.eval(), ExitConfig(layers=[2, 4], adapter_rank=0)).eval()


def test_check_continuations_finds_exactly_the_token_that_differs():
    m = _model()
    prompts = np.array([[1, 2, 3], [4, 5, 6]])
    greedy = np.array([reference_generate(m, p.tolist(), 6).tokens for p in prompts])  # full depth
    layers = np.full(greedy.shape, 4)
    layers[0, 1:] = 2  # unit 0's decode tokens "exited" at layer 2
    clean = check_continuations(Served.torch(m), prompts, greedy, layers, KVMode.DEFER).summary()
    assert (clean.tokens, clean.false_exits, clean.full_depth_mismatches) == (10, 0, 0)
    bad = greedy.copy()
    bad[:, -1] = (bad[:, -1] + 1) % 64  # the last token of each unit: no judged prefix contains it
    run = check_continuations(Served.torch(m), prompts, bad, layers, KVMode.DEFER)
    fe, mm = run.wrong()
    assert fe.tolist() == [[False] * 4 + [True], [False] * 5]  # unit 0's last token exited early
    assert mm.tolist() == [[False] * 5, [False] * 4 + [True]]  # unit 1's ran full depth
    assert run.unit_losses().tolist() == [0.2, 0.2]
    with pytest.raises(ConfigError, match="at least 2 new tokens"):
        check_continuations(Served.torch(m), prompts, greedy[:, :1], layers[:, :1], KVMode.DEFER)
    with pytest.raises(ConfigError, match="expected prompts"):
        check_continuations(Served.torch(m), prompts, greedy, layers[:, :3], KVMode.DEFER)


def test_free_run_at_full_depth_is_greedy_and_never_wrong():
    m = _model()
    prompts = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    run = free_run(Served.torch(m), prompts, 5, NeverExit(), KVMode.DEFER, batch=2)
    assert run.seqs[:, 3:].tolist() == [reference_generate(m, p.tolist(), 5).tokens for p in prompts]
    s = run.summary()
    assert (s.prompts, s.tokens, s.false_exits, s.full_depth_mismatches, s.exited_frac) == (3, 12, 0, 0, 0.0)
    assert s.layers_skipped_frac == 0.0 and run.data.n_units == 3


# ---------------------------------------------------------------- the served engine as its own reference
def test_engine_reference_on_torch_equals_teacher_forced_torch():
    """collect_engine (prefill, then one decode step per token) reads what collect_units reads
    teacher-forced: the same argmax at every exit, the same signals up to float32 rounding."""
    from calibration.collect import collect_engine, collect_units
    from edge.runtime.torch_backend import TorchBackend

    m = _model()
    seqs = np.random.default_rng(0).integers(0, 64, (5, 12))
    tf = collect_units(m, seqs, 4)
    eng = collect_engine(TorchBackend(m), seqs, 4, batch=3)  # two batches, the second partial
    assert eng.n == tf.n == 5 * 7 and eng.unit.tolist() == tf.unit.tolist()
    assert eng.next_token.tolist() == tf.next_token.tolist()
    for k in m.exit_layers:
        assert eng.argmax[k].tolist() == tf.argmax[k].tolist()
        # softmax statistics of the same logits from a different op order: float32 noise, relative
        np.testing.assert_allclose(eng.signals[k], tf.signals[k], rtol=1e-3, atol=1e-4)
    with pytest.raises(ConfigError, match="first judged position"):
        collect_engine(TorchBackend(m), seqs, 0)


@pytest.fixture(scope="module")
def quantized_ort(tmp_path_factory):
    """A W8A8 model (every layer and the head) exported to fused ONNX Runtime graphs: integer kernels."""
    from edge.compress.apply import calibrate_activations, observe, quantize_head, quantize_layers
    from edge.compress.quant import QuantSpec
    from edge.core.artifacts import sha256_path
    from edge.runtime.backend import make_backend
    from tests.unit.edge.runtime.test_engine import CFG as ENGINE_CFG, _model as engine_model
    from tests.unit.edge.runtime.test_ort_backend import _export

    m = engine_model(seed=4)  # head_dim 16: ONNX Runtime's fused attention
    quantize_layers(m, {j: QuantSpec() for j in range(ENGINE_CFG.num_layers)})
    quantize_head(m, QuantSpec())
    observe(m, [torch.randint(0, ENGINE_CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))])
    calibrate_activations(m)
    m, ckpt, graphs = _export(tmp_path_factory.mktemp("quant"), m)
    meta = json.loads((graphs / "graphs.json").read_text())
    assert meta["fused"] and meta["checkpoint_sha256"] == sha256_path(ckpt)
    import onnx

    ops = {n.op_type for n in onnx.load(str(graphs / meta["fused"]["graphs"]["segment_1"]["file"])).graph.node}
    assert "QuantizeLinear" in ops or "MatMulIntegerToFloat" in ops, ops  # integer kernels, not float
    return m, make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)


def test_the_served_engine_at_full_depth_is_never_wrong_against_itself(quantized_ort):
    """The reference of a non-torch engine is that engine at full depth, decode by decode: a full-depth
    free run is then exactly right, whatever the torch model would have said on near ties."""
    m, backend = quantized_ort
    prompts = np.random.default_rng(2).integers(0, 300, (6, 5))
    run = free_run(Served(backend), prompts, 8, NeverExit(), KVMode.DEFER, batch=4)
    s = run.summary()
    assert (s.tokens, s.false_exits, s.full_depth_mismatches) == (6 * 7, 0, 0)
    # and the reference is the engine's own decoding: its last exit predicts the engine's next token
    assert run.data.argmax[m.num_layers].reshape(6, 7).tolist() == run.seqs[:, 6:].tolist()


def test_an_exiting_engine_is_judged_against_its_own_full_depth(quantized_ort):
    """Tokens that exit and differ from the engine's full-depth token are false exits; the check finds the
    wrong ones (a rule that exits everything at the first exit) and only where the exit disagreed."""
    from edge.runtime.rules import ConfidenceRule

    m, backend = quantized_ort
    prompts = np.random.default_rng(3).integers(0, 300, (4, 5))
    run = free_run(Served(backend), prompts, 8, ConfidenceRule(0.0), KVMode.DEFER, batch=4)
    fe, mm = run.wrong()
    first = m.exit_layers[0]
    assert (run.judged == first).all()  # every decode token left at the first exit
    # wrong exactly where the first exit's argmax (what was emitted) differs from the full depth's
    ref = run.data
    differ = (ref.argmax[first] != ref.argmax[m.num_layers]).reshape(fe.shape)
    emitted = run.seqs[:, -fe.shape[1]:]
    assert (emitted == ref.argmax[first].reshape(fe.shape)).all()
    assert fe.tolist() == differ.tolist() and not mm.any()
    assert fe.any(), "an untrained model's first exit must disagree somewhere for this test to mean anything"


def test_the_reference_reads_the_engines_prompts_where_they_lie(quantized_ort):
    """The free run judges each chunk from the prompts' K/V the engine's prefill left in its cache (no second
    prefill); that reference equals one that prefills every prompt itself: the same token at every exit, the
    same check features up to float32 rounding (the prefill ran as one full-depth call there, segment by
    segment here). A slot list that does not fit the cache is refused."""
    from calibration.collect import collect_engine
    from edge.runtime.rules import ConfidenceRule

    m, backend = quantized_ort
    prompts = np.random.default_rng(5).integers(0, 300, (5, 6))
    for rule in (NeverExit(), ConfidenceRule(0.0)):  # full depth, and every decode token leaving early
        run = free_run(Served(backend), prompts, 7, rule, KVMode.DEFER, batch=3)  # two chunks, the second partial
        again = Served(backend).reference(run.seqs, prompts.shape[1])  # a cache of its own, every prompt prefilled
        assert again.unit.tolist() == run.data.unit.tolist()
        for k in m.exit_layers:
            assert again.argmax[k].tolist() == run.data.argmax[k].tolist()
            scale = np.abs(again.signals[k]).max() + 1.0
            np.testing.assert_allclose(run.data.signals[k], again.signals[k], rtol=0, atol=1e-5 * scale)
    with pytest.raises(ConfigError, match="one distinct slot each"):
        collect_engine(backend, run.seqs, prompts.shape[1], slots=np.array([0, 0, 1, 2, 3]))
    with pytest.raises(ConfigError, match="one distinct slot each"):
        collect_engine(backend, run.seqs, prompts.shape[1], slots=np.arange(99, 104))


def test_a_full_depth_run_reads_what_it_generates(quantized_ort):
    """Calibration's fit units in one pass (the reference generates the continuation it reads): the same
    tokens as a full-depth engine run, the same data as reading that run's tokens, none of them wrong."""
    from calibration.collect import generate_engine
    from calibration.freerun import full_depth_run

    m, backend = quantized_ort
    prompts = np.random.default_rng(6).integers(0, 300, (5, 6))
    engine = free_run(Served(backend), prompts, 7, NeverExit(), KVMode.DEFER, batch=3)
    one = full_depth_run(Served(backend), prompts, 7, batch=3)  # two chunks, the second partial
    assert one.seqs.tolist() == engine.seqs.tolist()
    assert (one.judged == m.num_layers).all() and one.data.unit.tolist() == engine.data.unit.tolist()
    s = one.summary()
    assert (s.tokens, s.false_exits, s.full_depth_mismatches) == (5 * 6, 0, 0)
    for k in m.exit_layers:
        assert one.data.argmax[k].tolist() == engine.data.argmax[k].tolist()
        scale = np.abs(engine.data.signals[k]).max() + 1.0
        np.testing.assert_allclose(one.data.signals[k], engine.data.signals[k], rtol=0, atol=1e-5 * scale)
    with pytest.raises(ConfigError, match="at least 2 new tokens"):
        generate_engine(backend, prompts, 1)
    with pytest.raises(ConfigError, match="expected prompts"):
        generate_engine(backend, prompts[:0], 4)
