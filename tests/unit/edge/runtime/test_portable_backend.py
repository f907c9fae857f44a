"""The backend over the portable graphs (edge/runtime/portable_backend.py) on ONNX Runtime: the engine
over it decodes what the engine over the torch reference decodes (batches over scattered slots, K/V
filled or deferred after exits, chunked prompts), its segment outputs agree with the reference's, and
what it cannot run (verification rows, gated models, TensorRT off a GPU, engines of another export)
is refused by name. TensorRT itself: tests/jetson/test_trt_backend.py."""
from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from edge.core.artifacts import sha256_file
from edge.core.errors import ArtifactError, ConfigError, MissingExtraError
from edge.runtime.backend import make_backend
from edge.runtime.cache import KVCache, contiguous_start
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.graphs import GRAPHS_JSON, load_graphs_json
from edge.runtime.portable_backend import ENGINES_JSON, OrtPortableBackend, check_engines
from edge.runtime.rules import ConfidenceRule
from edge.runtime.torch_backend import TorchBackend
from tests.tolerance import assert_f32_close
from tests.unit.edge.runtime.test_engine import CFG, _model, _prompts, _run
from tests.unit.edge.runtime.test_ort_backend import _export

# Two float32 paths (ONNX Runtime's CPU kernels vs torch's) agree to about eps32 * sqrt(n) per dot
# product of length n, relative to the compared values' scale (tests/tolerance.py: 16 * eps32 *
# sqrt(n) * layers). n: the longest reduction, the MLP's intermediate size; layers: the decoder layers a
# value went through, plus the exit's adapter and norm and the LM head.
REDUCTION = CFG.intermediate_size


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("portable"), _model(seed=11))


def _spy(backend):
    """Count the segment calls over scattered slots and the K/V fill calls the engine makes."""
    seen = {"scattered": 0, "kvfill": 0}
    segment, kvfill = backend._segment, backend._kvfill

    def spy_segment(i, x, slots, *args):
        seen["scattered"] += contiguous_start(slots) is None
        return segment(i, x, slots, *args)

    def spy_kvfill(*args):
        seen["kvfill"] += 1
        return kvfill(*args)

    backend._segment, backend._kvfill = spy_segment, spy_kvfill
    return seen


@pytest.mark.parametrize("mode", list(KVMode))
def test_same_tokens_exit_layers_and_cache_as_torch(exported, mode):
    """4 prompts in 4 slots, exits at every batch size: rows leave batches (scattered slots), and the
    layers an exit skips get their K/V from kvfill (propagate) or with the next token (defer)."""
    m, ckpt, graphs = exported
    prompts = _prompts(4, seed=12)
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=mode, defer_exit_max_batch=None)
    ref_engine = Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(0.3))
    ref = _run(ref_engine, prompts, max_tokens=16)
    backend = make_backend("onnxruntime_portable", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    assert isinstance(backend, OrtPortableBackend)
    seen = _spy(backend)
    engine = Engine(backend, EngineConfig(**cfg), ConfidenceRule(0.3))
    got = _run(engine, prompts, max_tokens=16)
    assert got == ref
    assert any(e < CFG.num_layers for seq in got for _, e in seq), "some tokens must exit early"
    assert seen["scattered"] > 0, "exits leave scattered slots: batches over them must have run"
    assert (seen["kvfill"] > 0) == (mode is KVMode.PROPAGATE)
    for j in range(CFG.num_layers):  # the K/V written where the reference wrote them
        for got_c, ref_c in ((engine.cache.keys[j], ref_engine.cache.keys[j]),
                             (engine.cache.values[j], ref_engine.cache.values[j])):
            assert_f32_close(got_c, ref_c, REDUCTION, j + 1, f"cache layer {j}")


@pytest.mark.parametrize("mode", list(KVMode))
def test_one_sequence_chunked_prompts_same_as_torch(exported, mode):
    """Batch 1, prompts of 1, 7 and 19 tokens in chunks of 8 (a chunk on a past, T > 1), and in defer
    mode the deferred rows run with the next token."""
    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime_portable", graphs_dir=graphs, threads=1)
    rng = np.random.default_rng(18)
    for n in (1, 7, 19):
        p = rng.integers(0, CFG.vocab_size, n).tolist()
        cfg = dict(max_seqs=1, max_len=128, prefill_budget=8, kv_mode=mode)
        ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(0.3)), [p], max_tokens=16)
        assert _run(Engine(backend, EngineConfig(**cfg), ConfidenceRule(0.3)), [p], max_tokens=16) == ref


def _compare(got, ref, layers: int, what: str) -> None:
    for field in ("hidden", "exit_hidden", "logits", "stats", "score"):
        r, g = getattr(ref, field), getattr(got, field)
        assert (g is None) == (r is None), f"{what} {field}"
        if r is not None:
            assert_f32_close(g, r, REDUCTION, layers, f"{what} {field}")
    if ref.token is not None:
        assert np.array_equal(got.token, ref.token), what


def test_segment_outputs_match_torch(exported):
    """Two prompts prefilled into slots 3 and 1, then one decode step of both (scattered slots, pasts of
    different lengths) through every segment, with a rule whose score reads every feature."""
    m, ckpt, graphs = exported
    backends = [TorchBackend(m), make_backend("onnxruntime_portable", graphs_dir=graphs, threads=1)]
    exits = list(m.exit_layers)
    rng = np.random.default_rng(5)
    forms = {layer: (rng.standard_normal(6).astype(np.float32), 0.5) for layer in exits[:-1]}
    for be in backends:
        be.attach(KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 4, 64))
        be.set_rule(forms)
    prompts = {3: rng.integers(0, CFG.vocab_size, 9), 1: rng.integers(0, CFG.vocab_size, 5)}

    def forward(be, x, slots, start, decide=True):
        outs, prev, h = [], None, x
        for i in range(len(be.segments)):
            out = be.segment(i, h, slots, start, prev, decide=decide)
            outs.append(out)
            h, prev = out.hidden, out
        return outs

    steps = []
    for be in backends:
        outs = [forward(be, ids[None].astype(np.int64), np.array([s]), np.array([0])) for s, ids in prompts.items()]
        last = np.array([[o[-1].token[0]] for o in outs])  # [2, 1]: each prompt's next token
        outs.append(forward(be, last, np.array([3, 1]), np.array([9, 5])))
        outs.append(forward(be, last[::-1].copy(), np.array([1, 3]), np.array([6, 10]), decide=False))
        steps.append(outs)
    ref, got = steps
    for s, (ref_step, got_step) in enumerate(zip(ref, got)):
        for i, (r, g) in enumerate(zip(ref_step, got_step)):
            _compare(g, r, exits[i] + 2, f"step {s} segment {i}")
    assert got[3][0].logits is None and got[3][0].hidden is not None  # decide=False: no head
    assert any(np.abs(r.score).max() > 0.1 for step in ref for r in step[:-1])  # the rule reads something


def test_verification_rows_refused(exported):
    _, _, graphs = exported
    backend = make_backend("onnxruntime_portable", graphs_dir=graphs, threads=1)
    backend.attach(KVCache(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 2, 64))
    last = len(backend.segments) - 1
    x = np.zeros((1, 3, CFG.hidden_size), np.float32)
    with pytest.raises(ConfigError, match="one exit row per sequence.*fused graphs of the 'onnxruntime' backend"):
        backend.segment(last, x, np.array([0]), np.array([0]), decide=False, rows=3)


def test_gated_model_refused(exported, tmp_path):
    """A gated export's graphs.json (the portable graphs have no gate output): refused before any graph
    is opened."""
    _, _, graphs = exported
    meta = load_graphs_json(graphs)
    meta["model"]["gated"] = True
    (tmp_path / GRAPHS_JSON).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="exit gates.*no gate output"):
        make_backend("onnxruntime_portable", graphs_dir=tmp_path)


def test_missing_graphs_dir_refused():
    with pytest.raises(ConfigError, match="needs graphs_dir"):
        make_backend("onnxruntime_portable")
    with pytest.raises(ConfigError, match="needs engines_dir"):
        make_backend("tensorrt", graphs_dir="x")


def test_tensorrt_without_tensorrt_names_what_to_install(exported, tmp_path, monkeypatch):
    _, _, graphs = exported
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, even where installed
    with pytest.raises(MissingExtraError) as err:
        make_backend("tensorrt", graphs_dir=graphs, engines_dir=tmp_path)
    msg = str(err.value)
    assert "TensorRT is not installed" in msg and "smartexit[tensorrt]" in msg and "onnxruntime_portable" in msg
    assert not isinstance(err.value, ImportError)


def _engines(graphs, out, meta):
    """An engines.json as `make jetson-engines` writes it (edge/jetson/engines.py build_all), with
    stand-in plan files."""
    out.mkdir()
    engines = {}
    for name, g in meta["graphs"].items():
        (out / f"{name}.plan").write_bytes(name.encode())
        engines[name] = {"file": f"{name}.plan", "precision": "fp16", "argv": ["trtexec"], "onnx_sha256": g["sha256"],
                         "plan_sha256": sha256_file(out / f"{name}.plan"), "tensorrt": "10.3.0", "build_seconds": 1.0}
    (out / ENGINES_JSON).write_text(json.dumps({"tensorrt": "10.3.0", "engines": engines}))
    return engines


def test_engines_of_this_export_accepted(exported, tmp_path):
    _, _, graphs = exported
    meta = load_graphs_json(graphs)
    engines = _engines(graphs, tmp_path / "engines", meta)
    assert check_engines(graphs, tmp_path / "engines", meta) == engines


@pytest.mark.parametrize("damage, match", [
    ("onnx_sha", r"graph 'segment_1' was built from ONNX sha256 0+.*make jetson-engines"),
    ("no_entry", r"no engine for graph 'segment_1'.*make jetson-engines"),
    ("no_plan", r"segment_1.plan \(the engine of graph 'segment_1'\) is missing.*make jetson-engines"),
    ("plan_changed", r"segment_1.plan \(the engine of graph 'segment_1'\) sha256 differs.*make jetson-engines"),
    ("no_json", r"engines.json is missing.*make jetson-engines"),
])
def test_engines_of_another_export_refused(exported, tmp_path, damage, match):
    _, _, graphs = exported
    meta = load_graphs_json(graphs)
    out = tmp_path / "engines"
    engines = _engines(graphs, out, meta)
    if damage == "onnx_sha":
        engines["segment_1"]["onnx_sha256"] = "0" * 64
    elif damage == "no_entry":
        del engines["segment_1"]
    elif damage == "no_plan":
        (out / "segment_1.plan").unlink()
    elif damage == "plan_changed":
        (out / "segment_1.plan").write_bytes(b"another plan")
    (out / ENGINES_JSON).write_text(json.dumps({"engines": engines}))
    if damage == "no_json":
        shutil.rmtree(out)
    with pytest.raises(ArtifactError, match=match):
        check_engines(graphs, out, meta)
