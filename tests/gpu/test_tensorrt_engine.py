"""On a CUDA GPU with TensorRT: engines of a tiny export agree with ONNX Runtime (CPU).

FP32 engines (TF32 off) are compared tightly; FP16 engines loosely, with every logits argmax
agreeing where the reference's top-2 margin is clear. Covered: prefill with an empty past (P = 0,
the profile's min), a batched decode step with a past, and the one LM head engine on a segment's
exit hidden.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.model.decoder import attention_mask
from exporters.onnx_config import ExportConfig
from exporters.onnx_export import export_onnx
from exporters.tensorrt import ENGINES_JSON, EngineBuildConfig, TrtRunner, build_engines
from tests.unit.exporters.test_onnx_export import CKPT, make_model, session

pytestmark = pytest.mark.gpu
trt = pytest.importorskip("tensorrt")

KV, HD, D = 2, 16, 64
SMALL = dict(max_batch=4, opt_batch=2, max_seq=16, opt_seq=1, max_past=32, opt_past=8, workspace_mib=256)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trt_gpu") / "onnx"
    export_onnx(make_model(), out, ExportConfig(), CKPT)
    return out


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def engines(request, graphs, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"plans_{request.param}")
    build_engines(graphs, out, EngineBuildConfig(precision=request.param, **SMALL), CKPT)
    return request.param, out


def _feeds(batch: int, seq: int, past: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    hidden = g.standard_normal((batch, seq, D)).astype(np.float32)
    positions = np.broadcast_to(np.arange(past, past + seq), (batch, seq)).astype(np.int64).copy()
    k_pos = torch.arange(past + seq).expand(batch, -1)
    mask = attention_mask(torch.from_numpy(positions), k_pos).numpy()  # [B, 1, T, P + T], causal
    feeds = {"hidden": hidden, "positions": positions, "attn_mask": mask,
             "exit_index": g.integers(0, seq, batch).astype(np.int64)}
    for j in (0, 1):
        feeds[f"past_key_{j}"] = g.standard_normal((batch, KV, past, HD)).astype(np.float32)
        feeds[f"past_value_{j}"] = g.standard_normal((batch, KV, past, HD)).astype(np.float32)
    return feeds


def _compare(precision: str, got: dict, ref: dict, logits: str | None = None) -> None:
    assert set(got) == set(ref)
    for name, r in ref.items():
        assert got[name].shape == r.shape, name
        scale = max(1.0, float(np.abs(r).max()))
        atol = 1e-4 * scale if precision == "fp32" else 2e-2 * scale
        np.testing.assert_allclose(got[name].astype(np.float32), r, atol=atol, rtol=0, err_msg=name)
    if logits:
        r = ref[logits].reshape(-1, ref[logits].shape[-1])
        top2 = np.sort(r, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 0.1 * max(1.0, float(np.abs(r).max()))
        assert clear.any()
        agree = got[logits].reshape(r.shape).argmax(-1) == r.argmax(-1)
        assert agree[clear].all()


def test_engines_json(engines):
    precision, out = engines
    meta = json.loads((out / ENGINES_JSON).read_text())
    assert sorted(meta["engines"]) == ["embed", "head", "kvfill_1", "segment_0", "segment_1"]
    seg = meta["engines"]["segment_0"]
    assert seg["precision"] == precision and seg["checkpoint_sha256"] == CKPT
    assert seg["shapes"]["past_key_0"] == {"min": [1, KV, 0, HD], "opt": [2, KV, 8, HD], "max": [4, KV, 32, HD]}
    assert meta["engines"]["head"]["shapes"] == {"exit_hidden": {"min": [1, 1, D], "opt": [2, 1, D], "max": [4, 1, D]}}
    assert (out / "timing.cache").stat().st_size > 0


def test_embed_matches_onnxruntime(engines, graphs):
    precision, out = engines
    ids = np.array([[5, 17, 3, 250, 9], [1, 2, 3, 4, 299]], np.int64)
    ref = dict(zip(["hidden"], session(graphs / "embed.onnx").run(None, {"input_ids": ids})))
    _compare(precision, TrtRunner(out / "embed.plan").run({"input_ids": ids}), ref)


@pytest.mark.parametrize("batch,seq,past", [(1, 6, 0), (3, 1, 7), (2, 3, 5)])
def test_segment_matches_onnxruntime(engines, graphs, batch, seq, past):
    precision, out = engines
    feeds = _feeds(batch, seq, past, seed=batch * 100 + past)
    sess = session(graphs / "segment_0.onnx")
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    got = TrtRunner(out / "segment_0.plan").run(feeds)
    _compare(precision, got, ref)
    # the head engine on the segment's exit hidden (ONNX Runtime's, so the head's own error is compared)
    head = session(graphs / "head.onnx")
    head_feeds = {"exit_hidden": ref["exit_hidden"]}
    head_ref = dict(zip([o.name for o in head.get_outputs()], head.run(None, head_feeds)))
    _compare(precision, TrtRunner(out / "head.plan").run(head_feeds), head_ref, logits="logits")


def test_shape_outside_profile_is_refused(engines):
    from edge.core.errors import ConfigError

    _, out = engines
    with pytest.raises(ConfigError, match="outside the engine's profile"):
        TrtRunner(out / "embed.plan").run({"input_ids": np.zeros((8, 1), np.int64)})  # max_batch is 4
