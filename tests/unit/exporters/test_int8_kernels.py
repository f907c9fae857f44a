"""INT8 matrix products on any x86 CPU: exact where MLAS's U8S8 kernel would saturate.

On x86 without VNNI, ONNX Runtime's default INT8 kernel adds pairs of byte products in 16-bit lanes
that saturate (|a1*w1 + a2*w2| > 32767 with activations near the top of their range). The sessions the
project opens ask for the exact U8U8 kernel on such CPUs (edge/runtime/ortsession.py), and the export
gives each Q/DQ pair its own zero point, without which that conversion fails to load the graph
(exporters/onnx_files.py own_zero_points). On a VNNI CPU (or aarch64) the kernel never saturates and
these tests pass either way; on an AVX2-only CPU they fail without those two changes.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edge.runtime.ortsession import int8_kernels, session_options
from exporters.onnx_files import own_zero_points

K, N = 64, 8


def _graph(shared_zero_point: bool) -> onnx.ModelProto:
    """y = DQ(Q(x)) @ DQ(w1) and z = DQ(Q(x)) @ DQ(w2), as the tracer writes W8A8 linears: two pairs
    (activation Q/DQ each, weights int8 codes per output channel), the zero points shared or not."""
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "a_scale")]
    zp = lambda name: numpy_helper.from_array(np.array(0, np.int8), name)  # noqa: E731
    inits += [zp("zp")] if shared_zero_point else [zp("zp_a1"), zp("zp_a2")]
    nodes = []
    for i in (1, 2):
        z = "zp" if shared_zero_point else f"zp_a{i}"
        codes = np.full((K, N), 127, np.int8)  # weights at the top of the grid: the saturating case
        inits += [numpy_helper.from_array(codes, f"w{i}"),
                  numpy_helper.from_array(np.full(N, 0.01, np.float32), f"w{i}_scale"),
                  numpy_helper.from_array(np.zeros(N, np.int8), f"w{i}_zp")]
        nodes += [helper.make_node("QuantizeLinear", ["x", "a_scale", z], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", "a_scale", z], [f"dq{i}"]),
                  helper.make_node("DequantizeLinear", [f"w{i}", f"w{i}_scale", f"w{i}_zp"], [f"wd{i}"], axis=1),
                  helper.make_node("MatMul", [f"dq{i}", f"wd{i}"], [f"y{i}"])]
    graph = helper.make_graph(nodes, "w8a8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["rows", N]) for i in (1, 2)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), session_options(ort), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def test_int8_products_are_exact_with_inputs_at_the_top_of_the_range():
    x = np.full((3, K), 127.0, np.float32)  # activation codes 127 (u8 255 after the kernel's +128)
    x[1] = -128.0
    x[2, ::2] = 100.0
    exact = (np.clip(np.round(x), -128, 127) @ np.full((K, N), 127.0 * 0.01)).astype(np.float32)
    for y in _run(_graph(shared_zero_point=False), x):
        # float rounding of the dequantised sums only; a saturated lane is off by thousands of codes
        np.testing.assert_allclose(y, exact, rtol=1e-5, err_msg=f"int8 kernels here: {int8_kernels()}")


def test_a_shared_zero_point_is_split_per_pair_and_the_graph_then_loads():
    model = _graph(shared_zero_point=True)
    assert own_zero_points(model.graph) == 1  # the second pair gets a copy
    zps = [n.input[2] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
           and n.input[2].startswith("zp")]
    assert zps == ["zp", "zp", "zp.1", "zp.1"]  # each pair reads one, its Q and DQ the same
    assert own_zero_points(model.graph) == 0  # nothing shared any more
    onnx.checker.check_model(model)
    x = np.linspace(-130, 130, 3 * K, dtype=np.float32).reshape(3, K)
    y1, y2 = _run(model, x)
    exact = (np.clip(np.round(x), -128, 127) @ np.full((K, N), 127.0 * 0.01)).astype(np.float32)
    np.testing.assert_allclose(y1, exact, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(y2, exact, rtol=1e-5, atol=1e-3)


def test_the_cache_is_kept_per_kind_of_int8_kernel():
    assert int8_kernels() in ("x86-vnni", "x86-u8u8") or not int8_kernels().startswith("x86")
