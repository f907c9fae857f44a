"""The engine on ONNX Runtime gives the same tokens and exit layers as on torch."""
from __future__ import annotations

import pytest

from edge.artifacts import atomic_dir, sha256_path
from edge.engine.backend import TorchBackend, make_backend
from edge.engine.engine import Engine, EngineConfig, KVMode
from edge.engine.ort_backend import pick_providers
from edge.engine.rules import ConfidenceRule
from edge.errors import ArtifactError, ConfigError
from edge.exits import save_multi_exit
from exporters.onnx_export import ExportConfig, export_onnx
from tests.unit.engine.test_engine import _model, _prompts, _run


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("ort")
    m = _model(seed=11)
    for p in m.backbone.parameters():  # the checkpoint stores fp16: compare the same weights
        p.data = p.data.half().float()
    ckpt = root / "ckpt"
    with atomic_dir(ckpt) as tmp:
        save_multi_exit(m, tmp, tokenizer=None, metrics={}, source={})
    export_onnx(m, root / "onnx", ExportConfig(), checkpoint_sha256=sha256_path(ckpt))
    return m, ckpt, root / "onnx"


@pytest.mark.parametrize("mode", list(KVMode))
def test_same_tokens_and_exit_layers_as_torch(exported, mode):
    m, ckpt, graphs = exported
    prompts = _prompts(4, seed=12)
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=mode)
    ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(0.3)), prompts, max_tokens=16)
    backend = make_backend("onnxruntime", m, graphs, checkpoint=ckpt, threads=1)
    got = _run(Engine(backend, EngineConfig(**cfg), ConfidenceRule(0.3)), prompts, max_tokens=16)
    assert got == ref
    assert any(e < 6 for seq in got for _, e in seq), "some tokens must exit early for the test to mean anything"


def test_graphs_from_another_checkpoint_refused(exported, tmp_path):
    m, ckpt, graphs = exported
    other = tmp_path / "other"
    with atomic_dir(other) as tmp:
        save_multi_exit(_model(seed=99), tmp, tokenizer=None, metrics={}, source={})
    with pytest.raises(ArtifactError, match="exported from checkpoint sha256"):
        make_backend("onnxruntime", m, graphs, checkpoint=other)


def test_provider_choice():
    assert pick_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert pick_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == "CUDAExecutionProvider"
    with pytest.raises(ConfigError, match="not available"):
        pick_providers(["CPUExecutionProvider"], ["TensorrtExecutionProvider"])


def test_backends_share_one_thread_pool(exported):
    """Every session of every backend in a process runs on one ONNX Runtime pool (sized once)."""
    m, ckpt, graphs = exported
    first = make_backend("onnxruntime", m, graphs, checkpoint=ckpt, threads=1)
    second = make_backend("onnxruntime", m, graphs, checkpoint=ckpt, threads=2)
    assert first.pool_threads == second.pool_threads
    prompts = _prompts(2, seed=13)
    cfg = dict(max_seqs=2, max_running=2, max_len=64, prefill_budget=16)
    assert _run(Engine(first, EngineConfig(**cfg)), prompts, 6) == _run(Engine(second, EngineConfig(**cfg)), prompts, 6)
