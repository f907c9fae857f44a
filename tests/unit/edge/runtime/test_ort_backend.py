"""The engine on ONNX Runtime (fused graphs, cache bound in place) gives the same tokens, exit layers
and cache contents as on torch."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge.core.artifacts import atomic_dir, sha256_path
from edge.runtime.backend import make_backend
from edge.runtime.torch_backend import TorchBackend
from edge.runtime.engine import Engine
from edge.runtime.engine_config import EngineConfig, KVMode
from edge.runtime.ort_backend import pick_providers
from edge.runtime.rules import ConfidenceRule
from edge.core.errors import ArtifactError, ConfigError
from edge.model.exits import save_multi_exit
from exporters.onnx_config import ExportConfig
from exporters.onnx_export import export_onnx
from tests.tolerance import assert_f32_close
from tests.unit.edge.runtime.test_engine import CFG, _model, _prompts, _run


def _export(root, m, **export):
    """Save ``m`` as a checkpoint and export it (``export``: ExportConfig's fields); returns (model, checkpoint,
    graphs)."""
    for p in m.backbone.parameters():  # the checkpoint stores fp16: compare the same weights
        p.data = p.data.half().float()
    ckpt = root / "ckpt"
    with atomic_dir(ckpt) as tmp:
        save_multi_exit(m, tmp, tokenizer=None, metrics={}, source={})
    export_onnx(m, root / "onnx", ExportConfig(**export), checkpoint_sha256=sha256_path(ckpt))
    return m, ckpt, root / "onnx"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("ort"), _model(seed=11))


@pytest.mark.parametrize("mode", list(KVMode))
def test_same_tokens_and_exit_layers_as_torch(exported, mode):
    m, ckpt, graphs = exported
    prompts = _prompts(4, seed=12)
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=mode,
               defer_exit_max_batch=None)  # rows exit at batch 4 too: the catch-up and gather paths
    ref_engine = Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(0.3))
    ref = _run(ref_engine, prompts, max_tokens=16)
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    engine = Engine(backend, EngineConfig(**cfg), ConfidenceRule(0.3))
    got = _run(engine, prompts, max_tokens=16)
    assert got == ref
    assert any(e < 6 for seq in got for _, e in seq), "some tokens must exit early for the test to mean anything"
    assert backend.gathered_rows > 0, "exits leave scattered slots: the gathered path must have run"
    for j in range(CFG.num_layers):  # the ORT engine wrote its K/V where the torch one did
        for got_c, ref_c in ((engine.cache.keys[j], ref_engine.cache.keys[j]),
                             (engine.cache.values[j], ref_engine.cache.values[j])):
            assert_f32_close(got_c, ref_c, CFG.hidden_size, CFG.num_layers, f"cache layer {j}")


def test_inline_deferral_gives_deferrals_tokens_and_gathers_nothing(exported):
    """EngineConfig.defer_inline (free-running calibration's engine): at batch 4, where deferral's owed rows
    need a pass of their own over scattered slots, computing them in the same step gives deferral's tokens
    and exit layers and gathers no past."""
    m, ckpt, graphs = exported
    prompts = _prompts(4, seed=12)
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=KVMode.DEFER,
               defer_exit_max_batch=None)
    deferred = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    ref = _run(Engine(deferred, EngineConfig(**cfg), ConfidenceRule(0.3)), prompts, max_tokens=16)
    inline = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    got = _run(Engine(inline, EngineConfig(**cfg, defer_inline=True), ConfidenceRule(0.3)), prompts, max_tokens=16)
    assert got == ref
    assert any(e < 6 for seq in got for _, e in seq), "some tokens must exit early for the test to mean anything"
    assert deferred.gathered_rows > 0 and inline.gathered_rows == 0


def test_decode_over_consecutive_slots_copies_no_past(exported):
    """Without exits every decode batch is one block of the cache: bound in place, nothing gathered."""
    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    _run(Engine(backend, EngineConfig(max_seqs=3, max_running=3, max_len=64)), _prompts(3, seed=14), 8)
    assert backend.gathered_rows == 0


def test_graphs_from_another_checkpoint_refused(exported, tmp_path):
    m, ckpt, graphs = exported
    other = tmp_path / "other"
    with atomic_dir(other) as tmp:
        save_multi_exit(_model(seed=99), tmp, tokenizer=None, metrics={}, source={})
    with pytest.raises(ArtifactError, match="exported from checkpoint sha256"):
        make_backend("onnxruntime", graphs_dir=graphs, checkpoint=other)


def test_provider_choice():
    assert pick_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert pick_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == "CUDAExecutionProvider"
    with pytest.raises(ConfigError, match="not available"):
        pick_providers(["CPUExecutionProvider"], ["TensorrtExecutionProvider"])


POOL = """
import json, os, sys
from edge.runtime.backend import make_backend
from edge.runtime.batch import run_batch
threads = lambda: len(os.listdir("/proc/self/task"))  # this process's OS threads
counts = [threads()]
first = make_backend("onnxruntime", graphs_dir=sys.argv[1], threads=3)
counts.append(threads())
others = [make_backend("onnxruntime", graphs_dir=sys.argv[1], threads=t) for t in (2, 4)]
tokens = [run_batch(b, None, [[1, 2, 3], [4, 5]], 4).tokens for b in [first] + others]
counts.append(threads())
print(json.dumps({"counts": counts, "pool": [b.pool_threads for b in [first] + others], "tokens": tokens}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_backends_share_one_thread_pool(exported):
    """In a fresh process: the first backend sizes ONNX Runtime's pool (3 threads: 2 workers besides
    the caller); backends opened after it, asking for other sizes, and every session they run add no
    thread. Per-session pools would add workers for each of their sessions."""
    _, _, graphs = exported
    out = subprocess.run([sys.executable, "-c", POOL, str(graphs)], cwd=Path(__file__).parents[4],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, first, after = got["counts"]
    assert first - before >= 2, got  # the pool's workers exist
    assert after == first, got
    assert got["pool"] == [3, 3, 3]
    assert got["tokens"][0] == got["tokens"][1] == got["tokens"][2]


def test_optimised_graphs_are_cached_and_rechecked(exported, tmp_path):
    """The first open writes ONNX Runtime's optimised graph next to the export (per ONNX Runtime version
    and kind of INT8 kernel); later opens use it; a cached graph that no longer matches its stamp is
    rebuilt, not trusted."""
    import shutil

    import onnxruntime as ort

    from edge.runtime.ortsession import CACHE_DIR, int8_kernels, open_session

    m, ckpt, graphs = exported
    src = tmp_path / "g"
    shutil.copytree(graphs, src, ignore=shutil.ignore_patterns(CACHE_DIR))
    path = src / "fused" / "segment_1.onnx"
    open_session(ort, path)
    cached = src / "fused" / CACHE_DIR / ort.__version__ / int8_kernels() / path.name
    assert cached.is_file() and cached.with_name(path.name + ".json").is_file()
    stamp = cached.stat().st_mtime_ns
    open_session(ort, path)
    assert cached.stat().st_mtime_ns == stamp  # reused, not rewritten
    cached.write_bytes(cached.read_bytes() + b"\0")  # tampered
    open_session(ort, path)
    assert cached.stat().st_mtime_ns != stamp
    assert sha256_path(src) == sha256_path(graphs)  # the cache is not part of the export's hash


@pytest.fixture(scope="module")
def exported_gated(tmp_path_factory):
    """The same kind of model with exit gates (random: the test needs decisions, not good ones)."""
    return _export(tmp_path_factory.mktemp("ort_gated"), _model(seed=15, gate_hidden=8))


@pytest.mark.parametrize("mode", list(KVMode))
def test_gated_exits_same_as_torch_and_head_only_for_exiting_rows(exported_gated, mode):
    from exporters.fused_parity import check_fused_parity

    m, ckpt, graphs = exported_gated
    assert check_fused_parity(m, graphs, _prompts(3, seed=16), decode_steps=2).passed
    prompts = _prompts(4, seed=17)
    cfg = dict(max_seqs=4, max_running=4, max_len=128, prefill_budget=24, kv_mode=mode,
               defer_exit_max_batch=None)  # rows exit at batch 4 too: the catch-up and gather paths
    rule = ConfidenceRule(0.5)
    ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), rule), prompts, max_tokens=16)
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    rows = []
    head = backend.head
    backend.head = lambda i, eh: rows.append(len(eh)) or head(i, eh)
    got = _run(Engine(backend, EngineConfig(**cfg), rule), prompts, max_tokens=16)
    assert got == ref
    early = sum(e < 6 for seq in got for _, e in seq)
    assert early > 0 and sum(rows) == early  # the LM head ran for exactly the rows that exited early


@pytest.mark.parametrize("mode", list(KVMode))
def test_one_sequence_with_exits_same_as_torch(exported, mode):
    """Batch 1: deferred rows run in the same call as the next token (T > 1 on the bound cache)."""
    m, ckpt, graphs = exported
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    for p in _prompts(3, seed=18):
        cfg = dict(max_seqs=1, max_len=128, kv_mode=mode)
        ref = _run(Engine(TorchBackend(m), EngineConfig(**cfg), ConfidenceRule(0.3)), [p], max_tokens=16)
        assert _run(Engine(backend, EngineConfig(**cfg), ConfidenceRule(0.3)), [p], max_tokens=16) == ref


SERVE = """
import json, resource, sys
from edge.runtime.backend import make_backend
from edge.runtime.batch import run_batch
from edge.runtime.rules import ConfidenceRule
backend = make_backend("onnxruntime", graphs_dir=sys.argv[1])
out = run_batch(backend, ConfidenceRule(0.3), [[1, 2, 3, 4], [5, 6, 7]], 8)
print(json.dumps({"tokens": out.tokens, "modules": sorted({m.split(".")[0] for m in sys.modules}),
                  "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_serving_from_the_export_alone_imports_no_torch(exported):
    """A fresh interpreter given only the export folder generates (the same tokens as torch) and never
    imports torch: what a Triton model or a Jetson runs. The import-linter contract checks the source;
    this runs it."""
    m, _, graphs = exported
    out = subprocess.run([sys.executable, "-c", SERVE, str(graphs)], cwd=Path(__file__).parents[4],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"edge", "onnxruntime", "numpy"} <= set(got["modules"])
    assert not set(got["modules"]) & {"torch", "transformers", "safetensors", "sklearn", "matplotlib"}, got["modules"]
    ref = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=2, max_running=2, max_len=64, prefill_budget=64),
                      ConfidenceRule(0.3)), [[1, 2, 3, 4], [5, 6, 7]], max_tokens=8)
    assert got["tokens"] == [[t for t, _ in seq] for seq in ref]


def test_no_exit_head_runs_above_the_deferral_batch_limit(exported):
    """Above ``defer_exit_max_batch`` nobody reads a decision exit's head: the ORT backend skips it, and
    the tokens stay the full model's."""
    m, ckpt, graphs = exported
    prompts = _prompts(3, seed=23)
    backend = make_backend("onnxruntime", graphs_dir=graphs, checkpoint=ckpt, threads=1)
    calls = []
    run = backend._head_sess.run_with_iobinding
    backend._head_sess.run_with_iobinding = lambda io: (calls.append(io), run(io))[1]
    cfg = dict(max_seqs=3, max_running=3, max_len=64, kv_mode=KVMode.DEFER)
    got = _run(Engine(backend, EngineConfig(**cfg), ConfidenceRule(0.0)), prompts, max_tokens=6)
    ref = _run(Engine(TorchBackend(m), EngineConfig(max_seqs=3, max_running=3, max_len=64)), prompts, max_tokens=6)
    assert got == ref
    # prefill: the last exit's head once per sequence; 5 decode steps: the last exit's head only
    assert len(calls) == 3 + 5
