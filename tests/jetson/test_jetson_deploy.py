"""On a Jetson (skipped elsewhere): the device check on the real device, and one real TensorRT engine built
with JetPack's trtexec, run on recorded inputs and compared with ONNX Runtime through the same functions
`make jetson-engines` uses (this also checks trtexec's --exportOutput format on the device)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, save

from edge.core.device import run_command
from edge.jetson import commands
from edge.jetson.check import evaluate, render, verdict
from edge.jetson.facts import collect
from edge.jetson.parity import compare_graph, parse_trtexec_outputs
from exporters.tensorrt import EngineBuildConfig, profile_shapes

pytestmark = pytest.mark.jetson


def test_check_on_this_device():
    facts = collect("/", lambda argv: run_command(argv, timeout=60),
                    os.environ.get("TRITON_HOME", "/opt/tritonserver"))
    rows = evaluate(facts)
    print(render(facts, rows))
    assert facts.jetson and facts.l4t is not None, facts.errors
    assert verdict(rows) in ("supported", "untested", "unsupported")


def test_engine_parity_with_real_trtexec(tmp_path: Path):
    if not Path(commands.TRTEXEC).is_file():
        pytest.skip(f"{commands.TRTEXEC} is not installed (sudo apt install libnvinfer-bin)")
    import onnxruntime as ort

    d = 64  # an LM-head-shaped graph: exit_hidden [B, 1, D] @ W [D, V]
    w = np.random.default_rng(0).standard_normal((d, 128)).astype(np.float32) / np.sqrt(d)
    x = helper.make_tensor_value_info("exit_hidden", TensorProto.FLOAT, ["batch", 1, d])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, 128])
    graph = helper.make_graph([helper.make_node("MatMul", ["exit_hidden", "w"], ["logits"])], "head", [x], [y],
                              [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.reshape(-1))])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "head.onnx")
    cfg = EngineBuildConfig(precision="fp16", max_batch=4, opt_batch=2, timing_cache=str(tmp_path / "timing.cache"))
    shapes = profile_shapes("head", ["exit_hidden"], {"hidden_size": d}, cfg)
    plan = tmp_path / "head.plan"
    res = run_command(commands.trtexec_build_argv(commands.TRTEXEC, tmp_path / "head.onnx", plan, shapes, cfg), 1800)
    assert res.returncode == 0, res.stdout[-3000:]
    feed = np.random.default_rng(1).standard_normal((2, 1, d)).astype(np.float32)
    (tmp_path / "exit_hidden.bin").write_bytes(feed.tobytes())
    ref = ort.InferenceSession(str(tmp_path / "head.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"exit_hidden": feed})[0]
    res = run_command(commands.trtexec_infer_argv(commands.TRTEXEC, plan, {"exit_hidden": [2, 1, d]},
                                                  {"exit_hidden": tmp_path / "exit_hidden.bin"}, tmp_path / "out.json"))
    assert res.returncode == 0, res.stdout[-3000:]
    got = parse_trtexec_outputs((tmp_path / "out.json").read_text())
    result = compare_graph("head", {"logits": ref}, got, "fp16", d, 1)
    assert result.passed, result.to_dict()
