"""On a Jetson with TensorRT (skipped elsewhere): the engine over the ``tensorrt`` backend decodes what it
decodes over ``onnxruntime_portable``, on the same portable graphs and prompts.

The test builds FP32 engines (TF32 off: an exact reference, exporters/tensorrt.py) of a tiny export
with TensorRT's Python API, so the two runtimes differ by float32 rounding only and the greedy tokens
and exit layers must agree. The FP16 / INT8 engines of a real run are checked against ONNX Runtime by
`make jetson-engines` itself (edge/jetson/parity.py), within their precision's tolerance.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from edge.core.artifacts import sha256_path
from edge.runtime.backend import make_backend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.rules import ConfidenceRule
from tests.unit.edge.runtime.test_engine import CFG, _model, _prompts, _run
from tests.unit.edge.runtime.test_ort_backend import _export

pytestmark = pytest.mark.jetson
trt = pytest.importorskip("tensorrt", reason="TensorRT's Python bindings are not installed (JetPack's "
                                             "python3-libnvinfer, or pip install 'smartexit[tensorrt]')")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("TensorRT is installed but torch sees no CUDA GPU (a CUDA build of torch is needed to run plans)",
                allow_module_level=True)

MAX_LEN, MAX_SEQS, CHUNK = 64, 4, 24


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(graphs, checkpoint, engines): a tiny export and its FP32 engines, with profiles that cover the
    engine config below (batch <= MAX_SEQS, chunk <= CHUNK, past < MAX_LEN)."""
    from exporters.tensorrt import EngineBuildConfig, build_engines

    root = tmp_path_factory.mktemp("trt_backend")
    _, ckpt, graphs = _export(root, _model(seed=11))
    cfg = EngineBuildConfig(precision="fp32", workspace_mib=256, max_batch=MAX_SEQS, opt_batch=2, max_seq=CHUNK,
                            opt_seq=1, max_past=MAX_LEN, opt_past=16)
    build_engines(graphs, root / "engines", cfg, sha256_path(ckpt))
    return graphs, ckpt, root / "engines"


@pytest.mark.parametrize("mode", list(KVMode))
def test_tensorrt_decodes_what_onnxruntime_decodes(built, mode):
    """4 prompts, exits at every batch size (scattered slots, K/V filled or deferred after exits)."""
    graphs, ckpt, engines = built
    prompts = _prompts(4, seed=12)
    cfg = dict(max_seqs=MAX_SEQS, max_running=MAX_SEQS, max_len=MAX_LEN, prefill_budget=CHUNK, kv_mode=mode,
               defer_exit_max_batch=None)
    ort_backend = make_backend("onnxruntime_portable", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    ref = _run(Engine(ort_backend, EngineConfig(**cfg), ConfidenceRule(0.3)), prompts, max_tokens=16)
    trt_backend = make_backend("tensorrt", graphs_dir=graphs, engines_dir=engines, checkpoint=ckpt)
    got = _run(Engine(trt_backend, EngineConfig(**cfg), ConfidenceRule(0.3)), prompts, max_tokens=16)
    assert got == ref
    assert any(e < CFG.num_layers for seq in got for _, e in seq), "some tokens must exit early"
