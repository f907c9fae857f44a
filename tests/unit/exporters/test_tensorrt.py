"""TensorRT engine building without TensorRT: profile shapes, trtexec command lines, the build
script, precision checks, and the clear error (with the script still written) where TensorRT or a
GPU is missing."""
from __future__ import annotations

import json
import shlex
import sys
import types
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from edge.core.artifacts import Manifest, sha256_path
from edge.core.errors import ArtifactError, ConfigError, MissingExtraError
from edge.pipeline import engines as engines_stage
from exporters import tensorrt as trt_export
from edge.runtime.graphs import load_graphs_json
from exporters.onnx_config import ExportConfig
from exporters.onnx_export import export_onnx
from exporters.tensorrt import (COMMANDS_JSON, SCRIPT, EngineBuildConfig, EnginesConfig, NoCudaDeviceError,
                                Precision, build_engines, graph_features, profile_shapes, trtexec_argv,
                                write_trtexec_script)
from tests.unit.exporters.test_onnx_export import CKPT, make_model

torch.set_num_threads(1)

# TINY in test_onnx_export: hidden 64, 4 heads, 2 KV heads -> head_dim 16; exits (2, 4)
D, KV, HD = 64, 2, 16


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trt") / "onnx"
    export_onnx(make_model(), out, ExportConfig(), CKPT)
    return out


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, even where installed


def test_config_validation():
    assert EngineBuildConfig(precision="fp32").precision is Precision.FP32
    with pytest.raises(ConfigError, match="precision"):
        EngineBuildConfig(precision="fp8")
    with pytest.raises(ConfigError, match="opt_batch=32 exceeds engines.max_batch=16"):
        EngineBuildConfig(opt_batch=32)
    with pytest.raises(ConfigError, match="max_seq"):
        EngineBuildConfig(max_seq=0)


def test_profile_shapes_every_graph_kind(graphs):
    meta = load_graphs_json(graphs)
    model, cfg = meta["model"], EngineBuildConfig()
    g = meta["graphs"]
    assert profile_shapes("embed", g["embed"]["inputs"], model, cfg) == {
        "input_ids": ((1, 1), (4, 1), (16, 256))}
    seg = profile_shapes("segment_1", g["segment_1"]["inputs"], model, cfg)
    assert list(seg) == g["segment_1"]["inputs"]  # graph order
    assert seg["hidden"] == ((1, 1, D), (4, 1, D), (16, 256, D))
    assert seg["positions"] == ((1, 1), (4, 1), (16, 256))
    # mask's last axis is P + T for each of min / opt / max
    assert seg["attn_mask"] == ((1, 1, 1, 0 + 1), (4, 1, 1, 128 + 1), (16, 1, 256, 512 + 256))
    for name in ("past_key_2", "past_value_2", "past_key_3", "past_value_3"):
        assert seg[name] == ((1, KV, 0, HD), (4, KV, 128, HD), (16, KV, 512, HD))
    kv = profile_shapes("kvfill_1", g["kvfill_1"]["inputs"], model, cfg)
    assert kv == {"hidden": ((1, 1, D), (4, 1, D), (16, 256, D)), "positions": ((1, 1), (4, 1), (16, 256))}
    # one LM head engine for every exit: one row per sequence, the batch axis only
    assert profile_shapes("head", g["head"]["inputs"], model, cfg) == {"exit_hidden": ((1, 1, D), (4, 1, D), (16, 1, D))}


def test_profile_shapes_rejects_bad_input(graphs):
    model = load_graphs_json(graphs)["model"]
    with pytest.raises(ArtifactError, match="unexpected input 'attn_mask'"):
        profile_shapes("kvfill_1", ["hidden", "attn_mask"], model, EngineBuildConfig())
    with pytest.raises(ArtifactError, match="unknown graph"):
        profile_shapes("lm_head", ["hidden"], model, EngineBuildConfig())
    with pytest.raises(ArtifactError, match="unknown graph"):  # one head for every exit, not one per exit
        profile_shapes("head_0", ["exit_hidden"], model, EngineBuildConfig())
    with pytest.raises(ArtifactError, match="unexpected input 'hidden'"):
        profile_shapes("head", ["hidden"], model, EngineBuildConfig())
    with pytest.raises(ArtifactError, match="'num_kv_heads'"):
        profile_shapes("segment_0", ["past_key_0"], {"hidden_size": D}, EngineBuildConfig())


def test_trtexec_argv_full_list():
    shapes = {"hidden": ((1, 1, 64), (4, 1, 64), (16, 256, 64)),
              "attn_mask": ((1, 1, 1, 1), (4, 1, 1, 129), (16, 1, 256, 768)),
              "past_key_0": ((1, 2, 0, 16), (4, 2, 128, 16), (16, 2, 512, 16))}
    argv = trtexec_argv("../onnx/segment_0.onnx", "segment_0.plan", shapes, EngineBuildConfig())
    assert argv == [
        "trtexec", "--onnx=../onnx/segment_0.onnx", "--saveEngine=segment_0.plan",
        "--minShapes=hidden:1x1x64,attn_mask:1x1x1x1,past_key_0:1x2x0x16",
        "--optShapes=hidden:4x1x64,attn_mask:4x1x1x129,past_key_0:4x2x128x16",
        "--maxShapes=hidden:16x256x64,attn_mask:16x1x256x768,past_key_0:16x2x512x16",
        "--memPoolSize=workspace:1024M", "--fp16", "--timingCacheFile=timing.cache",
        "--profilingVerbosity=detailed", "--dumpLayerInfo",
    ]
    flags = lambda **kw: [a for a in trtexec_argv("a.onnx", "a.plan", shapes, EngineBuildConfig(**kw))  # noqa: E731
                          if a in ("--fp16", "--int8", "--noTF32", "--stronglyTyped")]
    assert flags(precision="fp32") == ["--noTF32"]
    assert flags(precision="int8") == ["--fp16", "--int8"]
    assert flags(strongly_typed=True) == flags(precision="int8", strongly_typed=True) == ["--stronglyTyped"]
    assert "--timingCacheFile=/tmp/c.cache" in trtexec_argv("a.onnx", "out/a.plan", shapes,
                                                            EngineBuildConfig(timing_cache="/tmp/c.cache"))


def test_script_one_trtexec_line_per_graph(graphs, tmp_path):
    out = tmp_path / "engines"
    script = write_trtexec_script(graphs, out, EngineBuildConfig())
    assert script == out / SCRIPT and script.stat().st_mode & 0o111
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text and "Jetson" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("trtexec ")]
    names = sorted(load_graphs_json(graphs)["graphs"])
    assert names == ["embed", "head", "kvfill_1", "segment_0", "segment_1"]  # one head engine, whatever the exits
    assert len(lines) == len(names)
    commands = json.loads((out / COMMANDS_JSON).read_text())["commands"]
    assert sorted(commands) == names
    for line in lines:  # each line parses back to the recorded argv; paths relative to the script's folder
        argv = shlex.split(line)
        name = Path(argv[2].split("=", 1)[1]).stem
        assert argv == commands[name]
        onnx_rel = argv[1].split("=", 1)[1]
        assert not Path(onnx_rel).is_absolute() and (out / onnx_rel).resolve() == (graphs / f"{name}.onnx").resolve()
        assert argv[2] == f"--saveEngine={name}.plan"


def test_int8_refused_without_qdq(graphs, tmp_path):
    with pytest.raises(ConfigError, match=r"int8 .*segment_0.*QuantizeLinear/DequantizeLinear"):
        write_trtexec_script(graphs, tmp_path / "engines", EngineBuildConfig(precision="int8"))
    assert not (tmp_path / "engines" / SCRIPT).exists()  # nothing half-written
    with pytest.raises(ConfigError, match="float16"):  # strongly typed fp16 on an fp32 graph builds fp32
        write_trtexec_script(graphs, tmp_path / "engines", EngineBuildConfig(strongly_typed=True))


def test_graph_features_sees_qdq(graphs, tmp_path):
    assert graph_features(graphs / "segment_0.onnx") == {"qdq": False, "matmul": True, "fp16": False}
    assert graph_features(graphs / "embed.onnx")["matmul"] is False  # a table lookup: exempt from the int8 rule
    assert graph_features(graphs / "head.onnx")["matmul"] is True
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s"], ["d"]),
             helper.make_node("MatMul", ["d", "d"], ["y"])]
    path = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], [scale])), str(path))
    assert graph_features(path) == {"qdq": True, "matmul": True, "fp16": False}


def test_build_engines_without_tensorrt_names_where_to_build(graphs, tmp_path, no_tensorrt):
    out = tmp_path / "engines"
    with pytest.raises(MissingExtraError) as err:
        build_engines(graphs, out, EngineBuildConfig(), CKPT)
    msg = str(err.value)
    assert "TensorRT is not installed" in msg and "Jetson" in msg and str(out / SCRIPT) in msg
    assert "smartexit[tensorrt]" in msg and "NVIDIA GPU" in msg
    assert len([ln for ln in (out / SCRIPT).read_text().splitlines() if ln.startswith("trtexec ")]) == 5
    assert not list(out.glob("*.plan")) and not (out / "engines.json").exists()


def test_build_engines_checks_checkpoint_first(graphs, tmp_path, no_tensorrt):
    with pytest.raises(ArtifactError, match="exported from checkpoint"):
        build_engines(graphs, tmp_path / "engines", EngineBuildConfig(), "d" * 64)
    assert not (tmp_path / "engines").exists()


def test_build_engines_without_gpu(graphs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoCudaDeviceError, match="no CUDA GPU"):
        build_engines(graphs, tmp_path / "engines", EngineBuildConfig(), CKPT)
    assert (tmp_path / "engines" / SCRIPT).is_file()


@pytest.mark.slow  # ~6 s
def test_main_reads_manifest_and_records_nothing_on_failure(graphs, tmp_path, no_tensorrt):
    run = tmp_path / "run"
    ckpt = run / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    onnx_dir = run / "onnx"
    export_onnx(make_model(), onnx_dir, ExportConfig(), sha256_path(ckpt))
    m = Manifest(run)
    m.record("distill", inputs={}, config={}, outputs={"checkpoint": ckpt}, metrics={}, seconds=0)
    m.record("export", inputs={}, config={}, outputs={"graphs": onnx_dir}, metrics={}, seconds=0)
    with pytest.raises(MissingExtraError, match=str(run / "engines" / SCRIPT)):
        engines_stage.main(EnginesConfig(run_dir=str(run)))
    assert (run / "engines" / SCRIPT).is_file()
    assert "engines" not in Manifest(run).data["stages"]
