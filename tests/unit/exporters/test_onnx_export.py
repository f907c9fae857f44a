"""ONNX export of a tiny multi-exit model: graphs match torch in ONNX Runtime, axes are dynamic,
hashes bind graphs to their checkpoint, and a broken graph fails the parity gate loudly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge.model.config import Arch, ModelConfig
from edge.core.errors import ArtifactError, ConfigError
from edge.model.exits import ExitConfig, MultiExitModel, exit_decision_stats
from edge.model.decoder import Decoder, attention_mask
from edge.runtime.ortsession import session_options
from exporters import onnx_export
from edge.runtime.graphs import FUSED_DIR, GRAPHS_JSON, verify_graphs
from exporters.onnx_config import ExportConfig
from exporters.onnx_export import export_onnx
from exporters.onnx_graphs import segment_io
from exporters.fused_parity import check_fused_parity
from exporters.parity import PARITY_ATOL, ParityReport, check_parity, require_parity
from tests.tolerance import assert_f32_close

torch.set_num_threads(1)  # the machine is shared; tiny models need no more

CKPT = "c" * 64
PROMPTS = [[5, 17, 3, 250, 9], [1, 2, 3], [42, 7, 7, 100, 199, 8, 64, 11]]
TINY = dict(vocab_size=300, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=96,
            max_position_embeddings=128)


def make_model(seed: int = 0, layers: tuple[int, ...] = (2, 4), **overrides) -> MultiExitModel:
    dec = Decoder(ModelConfig(**{**TINY, **overrides}))
    dec.init_weights(seed, std=0.2)
    if dec.cfg.qkv_bias:  # init_weights zeroes biases; make them matter
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in dec.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model = MultiExitModel(dec, ExitConfig(layers=list(layers), adapter_rank=4))
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # exit heads start as copies of the final norm with a zero adapter
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), session_options(ort), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[MultiExitModel, Path]:
    model = make_model()
    out = tmp_path_factory.mktemp("onnx") / "graphs"
    export_onnx(model, out, ExportConfig(), CKPT)
    return model, out


def test_parity_prefill_and_batched_decode(exported):
    model, out = exported
    report = check_parity(model, out, PROMPTS)
    assert report.passed, report.failures
    assert report.argmax_agreement == 1.0
    assert set(report.max_abs_diff) == {"embed", "segment_0", "segment_1", "kvfill_1", "head"}  # every graph ran
    json.dumps(report.to_dict())
    require_parity(report)  # does not raise


def test_graphs_json_checker_opset_no_contrib(exported):
    _, out = exported
    meta = json.loads((out / GRAPHS_JSON).read_text())
    assert meta["exit_layers"] == [2, 4] and meta["opset"] == 17 and meta["checker"] == {"onnx": onnx.__version__}
    assert {g["checker"] for g in meta["graphs"].values()} == {"passed (full_check, shape inference)"}
    assert meta["checkpoint_sha256"] == CKPT
    assert [s["layers"] for s in meta["segments"]] == [[0, 1], [2, 3]]
    assert sorted(meta["graphs"]) == ["embed", "head", "kvfill_1", "segment_0", "segment_1"]
    assert meta["graphs"]["segment_1"]["inputs"] == [
        "hidden", "positions", "attn_mask", "past_key_2", "past_value_2", "past_key_3", "past_value_3", "exit_index"]
    assert meta["graphs"]["segment_1"]["outputs"] == [
        "hidden_out", "exit_hidden", "present_key_2", "present_value_2", "present_key_3", "present_value_3"]
    assert meta["graphs"]["head"]["inputs"] == ["exit_hidden"]
    assert meta["graphs"]["head"]["outputs"] == ["logits", "exit_stats", "exit_token"]
    assert meta["graphs"]["kvfill_1"]["inputs"] == ["hidden", "positions"]
    for g in meta["graphs"].values():
        path = out / g["file"]
        onnx.checker.check_model(str(path))
        proto = onnx.load(str(path))
        assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [17]
        assert not [n for n in proto.graph.node if n.domain == "com.microsoft"]
        assert [i.name for i in proto.graph.input] == g["inputs"]
        assert [o.name for o in proto.graph.output] == g["outputs"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def _segment_ref(model, i, layers, h, pos, mask, past, exit_index):
    cos, sin = model.backbone.rope(pos)
    presents = []
    for j in layers:
        h, k, v = model.backbone.layers[j](h, cos, sin, *past[j], mask)
        presents += [k, v]
    rows = h[torch.arange(h.shape[0]), exit_index].unsqueeze(1)  # [B, 1, D]: the exit runs on these only
    return [h, model.exit_hidden(model.exit_layers[i], rows), *presents]


def _assert_matches(got, ref, reduction, layers, what):
    """ORT vs torch, fp32: relative tolerance (tests/tolerance.py); integer outputs (argmax) exactly."""
    assert got.shape == tuple(ref.shape), f"{what}: shape {got.shape} != {tuple(ref.shape)}"
    if np.issubdtype(got.dtype, np.integer):
        np.testing.assert_array_equal(got, ref.numpy(), err_msg=what)
    else:
        assert_f32_close(got, ref.numpy(), reduction, layers, what)


@pytest.mark.parametrize("b,t,p", [(1, 1, 0), (1, 5, 7), (3, 1, 7), (3, 5, 0)])
def test_axes_are_dynamic(exported, b, t, p):
    model, out = exported
    cfg = model.backbone.cfg
    g = torch.Generator().manual_seed(b * 100 + t * 10 + p)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    pos = (torch.arange(t) + p).unsqueeze(0).repeat(b, 1)
    k_pos = torch.cat((torch.arange(p).unsqueeze(0).repeat(b, 1), pos), 1)
    mask = attention_mask(pos, k_pos)
    past = [tuple(torch.randn(b, cfg.num_kv_heads, p, cfg.head_dim, generator=g) for _ in range(2))
            for _ in range(cfg.num_layers)]
    head = session(out / "head.onnx")
    with torch.no_grad():
        h = model.backbone.embed(ids)
        (got,) = session(out / "embed.onnx").run(None, {"input_ids": ids.numpy()})
        _assert_matches(got, h, 1, 1, "embed")
        for i, layers in enumerate([[0, 1], [2, 3]]):
            exit_index = torch.randint(0, t, (b,), generator=g)  # a different row per sequence
            feeds = {"hidden": h.numpy(), "positions": pos.numpy(), "attn_mask": mask.numpy(),
                     "exit_index": exit_index.numpy()}
            for j in layers:
                feeds[f"past_key_{j}"], feeds[f"past_value_{j}"] = past[j][0].numpy(), past[j][1].numpy()
            got = session(out / f"segment_{i}.onnx").run(None, feeds)
            ref = _segment_ref(model, i, layers, h, pos, mask, past, exit_index)
            assert len(got) == len(ref)
            for name, o, r in zip(segment_io(layers)[1], got, ref):
                # two layers of dot products up to the MLP width (attention over at most P + T rows)
                _assert_matches(o, r, cfg.intermediate_size, len(layers), f"segment_{i}/{name}")
            logits = torch.nn.functional.linear(ref[1], model.backbone.head_weight)  # [B, 1, V]
            head_ref = [logits, *exit_decision_stats(logits)]
            for name, o, r in zip(("logits", "exit_stats", "exit_token"), head.run(None, {"exit_hidden": got[1]}), head_ref):
                _assert_matches(o, r, cfg.hidden_size, 1, f"head/{name} after segment_{i}")
            h = ref[0]


def test_kvfill_equals_kv_only(exported):
    model, out = exported
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 4, 64, generator=g)
    pos = torch.tensor([[3, 4, 5, 6], [10, 11, 12, 13]])
    got = session(out / "kvfill_1.onnx").run(None, {"hidden": h.numpy(), "positions": pos.numpy()})
    cos, sin = model.backbone.rope(pos)
    with torch.no_grad():
        ref = [x for j in (2, 3) for x in model.backbone.layers[j].kv_only(h, cos, sin)]
    assert len(got) == 4
    for o, r in zip(got, ref):
        _assert_matches(o, r, 64, 1, "kvfill_1")  # one projection of length hidden_size


@pytest.mark.slow  # ~6 s: exports a second checkpoint
def test_verify_graphs_refuses_other_checkpoint_and_tampered_graph(exported, tmp_path):
    model, out = exported
    assert verify_graphs(out, CKPT)["exit_layers"] == [2, 4]
    with pytest.raises(ArtifactError, match=f"{CKPT}.*expected {'d' * 64}"):
        verify_graphs(out, "d" * 64)
    # a segment graph from another checkpoint dropped into the folder
    other = tmp_path / "other"
    export_onnx(make_model(seed=7), other, ExportConfig(), "e" * 64)
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    shutil.copyfile(other / "segment_1.onnx", mixed / "segment_1.onnx")
    with pytest.raises(ArtifactError, match=r"segment_1\.onnx.*sha256 [0-9a-f]{64} != recorded [0-9a-f]{64}"):
        verify_graphs(mixed, CKPT)
    (mixed / "segment_1.onnx").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        verify_graphs(mixed, CKPT)
    with pytest.raises(ArtifactError, match="graphs.json is missing"):
        verify_graphs(tmp_path, CKPT)


@pytest.mark.slow  # ~7 s each: a fresh export per family (the default family's export is the module fixture)
@pytest.mark.parametrize("overrides", [
    dict(arch=Arch.QWEN2, qkv_bias=True, num_kv_heads=1),
    dict(arch=Arch.MISTRAL, sliding_window=4, tie_word_embeddings=False),
    dict(rope={"rope_type": "llama3", "factor": 8.0, "theta": 500000.0, "original_max_position_embeddings": 32},
         o_bias=True, num_kv_heads=4),
], ids=["qwen2_bias_mqa", "mistral_window", "llama3_rope_mha"])
def test_other_families_export_and_pass_parity(tmp_path, overrides):
    model = make_model(seed=1, layers=(1, 3, 4), **overrides)
    man = export_onnx(model, tmp_path / "g", ExportConfig(), CKPT)
    assert sorted(man.graphs) == ["embed", "head", "kvfill_1", "kvfill_2", "segment_0", "segment_1", "segment_2"]
    report = check_parity(model, tmp_path / "g", PROMPTS, decode_steps=2)
    assert report.passed, report.failures
    fused = check_fused_parity(model, tmp_path / "g", PROMPTS, decode_steps=2)
    assert fused.passed, fused.failures


def test_opset_18_and_external_data(tmp_path):
    model = make_model(seed=2)
    man = export_onnx(model, tmp_path / "g", ExportConfig(opset=18, external_data_threshold=0), CKPT)
    seg = man.graphs["segment_0"]
    assert seg.external_data == "segment_0.onnx.data" and (tmp_path / "g" / seg.external_data).is_file()
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == sorted(
        [GRAPHS_JSON, FUSED_DIR] + [f"{n}.onnx" for n in man.graphs] + [f"{n}.onnx.data" for n in man.graphs])
    assert sorted(p.name for p in (tmp_path / "g" / FUSED_DIR).iterdir()) == sorted(
        [f"{n}.onnx" for n in man.fused] + [f"{n}.onnx.data" for n in man.fused])
    verify_graphs(tmp_path / "g", CKPT)
    report = check_parity(model, tmp_path / "g", PROMPTS[:2], decode_steps=1)
    assert report.passed, report.failures
    assert check_fused_parity(model, tmp_path / "g", PROMPTS[:2], decode_steps=1).passed
    with open(tmp_path / "g" / seg.external_data, "r+b") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(ArtifactError, match=r"segment_0\.onnx\.data"):
        verify_graphs(tmp_path / "g", CKPT)


def test_export_config_validation():
    with pytest.raises(ConfigError, match="opset"):
        ExportConfig(opset=13)
    with pytest.raises(ConfigError, match="differ"):
        ExportConfig(trace_batch=3, trace_seq=3)


@pytest.mark.slow  # ~6 s: exports again into an existing folder
def test_failed_export_leaves_previous_folder(exported, tmp_path, monkeypatch):
    model, out = exported
    target = tmp_path / "g"
    shutil.copytree(out, target)
    before = (target / GRAPHS_JSON).read_text()

    def broken(*args, **kwargs):
        raise ArtifactError("checker said no")

    monkeypatch.setattr(onnx_export, "finish_graph", broken)
    with pytest.raises(ArtifactError, match="checker said no"):
        export_onnx(model, target, ExportConfig(), "f" * 64)
    assert (target / GRAPHS_JSON).read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_parity_gate_fails_with_numbers(exported, tmp_path):
    model, out = exported
    # (1) the graphs against a different model
    report = check_parity(make_model(seed=5), out, PROMPTS[:2], decode_steps=1)
    assert not report.passed and report.failures
    with pytest.raises(ArtifactError, match=r"parity failed.*argmax agreement .*%.*segment_\d/\w+ \d"):
        require_parity(report)
    # (2) one weight of segment_1 perturbed in the graph itself
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    proto = onnx.load(str(bad / "segment_1.onnx"))
    init = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))
    arr = onnx.numpy_helper.to_array(init).copy()
    arr[0] += 0.5
    init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    onnx.save(proto, str(bad / "segment_1.onnx"))
    report = check_parity(model, bad, PROMPTS[:2], decode_steps=1)
    assert not report.passed
    assert max(report.max_abs_diff["segment_0"].values()) < PARITY_ATOL  # the untouched graph still passes
    assert report.max_abs_diff["segment_1"]["hidden_out"] > 100 * PARITY_ATOL
    with pytest.raises(ArtifactError, match=r"segment_1/(logits|exit_hidden|hidden_out) \d"):
        require_parity(report)


def test_require_parity_lists_worst_first():
    report = ParityReport(False, {"embed": {"hidden": 0.0}, "segment_1": {"logits": 0.3, "hidden_out": float("nan")}},
                          0.5, ["segment_1/logits (decode step 0): max abs diff 0.3"])
    worst_first = r"50\.00%.*segment_1/hidden_out nan, segment_1/logits 0\.3, embed/hidden 0"
    with pytest.raises(ArtifactError, match=worst_first):
        require_parity(report)


def test_check_parity_rejects_empty_prompts(exported):
    model, out = exported
    with pytest.raises(ConfigError):
        check_parity(model, out, [])
    with pytest.raises(ConfigError):
        check_parity(model, out, [[1, 2], []])
