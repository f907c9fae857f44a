"""settle(): the benches wait for the last system's threads to stop spinning before timing the next
(edge/pipeline/bench/quiesce.py). A thread that burns CPU stands for a runtime's spinning pool; ONNX
Runtime's own pool is the real one."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edge.pipeline.bench.quiesce import settle


def _cpu_over(seconds: float) -> float:
    c0 = time.process_time()
    time.sleep(seconds)
    return time.process_time() - c0


def _burner(cpu_s: float, stop: threading.Event | None = None) -> threading.Thread:
    """A thread spinning until it has used ``cpu_s`` of CPU (or until ``stop`` is set)."""
    def spin() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < cpu_s and not (stop is not None and stop.is_set()):
            pass
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    return t


def test_settle_waits_for_a_spinning_thread_to_stop():
    burner = _burner(0.06)
    waited = settle()
    assert not burner.is_alive(), "settle returned while a thread of the process still spun"
    assert waited >= 0.03  # it did wait: the thread needed ~60 ms of CPU
    assert _cpu_over(0.02) < 0.01


def test_settle_gives_up_after_its_limit_on_a_thread_that_never_stops():
    stop = threading.Event()
    burner = _burner(3600.0, stop)
    try:
        waited = settle(limit_s=0.1)
        assert burner.is_alive() and waited >= 0.1
    finally:
        stop.set()
        burner.join(5)


def test_settle_returns_at_once_on_a_quiet_process():
    assert settle() < 0.1


def test_settle_rejects_bad_arguments():
    for kw in ({"window_s": 0.0}, {"quiet": 1.0}, {"quiet": -0.1}, {"limit_s": -1.0}):
        with pytest.raises(ValueError):
            settle(**kw)


def test_onnx_runtime_pool_is_quiet_after_settle(tmp_path):
    """The real case: ONNX Runtime's shared intra-op pool (the benches' sessions) after a run."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from edge.runtime.ortsession import open_session

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])], [w])
    path = tmp_path / "mm.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    sess = open_session(ort, path, threads=2, cache=False)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    for _ in range(200):
        sess.run(["y"], {"x": x})
    settle()
    assert _cpu_over(0.02) < 0.01
