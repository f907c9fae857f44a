"""settle(): the benches wait for the last system's threads to stop spinning before timing the next
(edge/pipeline/bench/quiesce.py). A thread that burns CPU stands for a runtime's spinning pool; ONNX
Runtime's own pool is the real one.

The tests that read this process's CPU time run in a fresh interpreter: in the whole suite the test process
holds other tests' threads (Ray's driver, servers' clients), whose background work would be read as spinning
(CI, 2026-12-05: 19 ms of CPU in a 20 ms window after ONNX Runtime's pool had settled)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge.pipeline.bench.quiesce import settle

ROOT = Path(__file__).parents[5]

PRELUDE = """
import json, threading, time
from edge.pipeline.bench.quiesce import settle

def cpu_over(seconds):
    c0 = time.process_time()
    time.sleep(seconds)
    return time.process_time() - c0

def burner(cpu_s, stop=None):
    # a thread spinning until it has used cpu_s of CPU (or until stop is set)
    def spin():
        t0 = time.thread_time()
        while time.thread_time() - t0 < cpu_s and not (stop is not None and stop.is_set()):
            pass
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    return t
"""


def _fresh(body: str) -> dict:
    """Run ``PRELUDE`` + ``body`` (which prints one JSON line last) in a fresh interpreter; its result."""
    out = subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_settle_waits_for_a_spinning_thread_to_stop():
    got = _fresh("""
t = burner(0.06)
waited = settle()
print(json.dumps({"alive": t.is_alive(), "waited": waited, "cpu": cpu_over(0.02)}))
""")
    assert not got["alive"], "settle returned while a thread of the process still spun"
    assert got["waited"] >= 0.03  # it did wait: the thread needed ~60 ms of CPU
    assert got["cpu"] < 0.01


def test_settle_gives_up_after_its_limit_on_a_thread_that_never_stops():
    got = _fresh("""
stop = threading.Event()
t = burner(3600.0, stop)
waited = settle(limit_s=0.1)
alive = t.is_alive()
stop.set()
t.join(5)
print(json.dumps({"alive": alive, "waited": waited}))
""")
    assert got["alive"] and got["waited"] >= 0.1


def test_settle_returns_at_once_on_a_quiet_process():
    assert _fresh('print(json.dumps({"waited": settle()}))')["waited"] < 0.1


def test_settle_rejects_bad_arguments():
    for kw in ({"window_s": 0.0}, {"quiet": 1.0}, {"quiet": -0.1}, {"limit_s": -1.0}):
        with pytest.raises(ValueError):
            settle(**kw)


def test_onnx_runtime_pool_is_quiet_after_settle(tmp_path):
    """The real case: ONNX Runtime's shared intra-op pool (the benches' sessions) after a run; and without
    ``settle`` the same pool is still spinning when the run returns (what the benches had timed into the next
    system)."""
    pytest.importorskip("onnxruntime")
    got = _fresh(f"""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from edge.runtime.ortsession import open_session

rng = np.random.default_rng(0)
w = numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])], [w])
path = {str(tmp_path / "mm.onnx")!r}
open(path, "wb").write(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
sess = open_session(ort, path, threads=2, cache=False)
x = rng.standard_normal((64, 256)).astype(np.float32)
def run():
    for _ in range(200):
        sess.run(["y"], {{"x": x}})
run()
spinning = cpu_over(0.005)
run()
settle()
print(json.dumps({{"spinning": spinning, "settled": cpu_over(0.02)}}))
""")
    assert got["settled"] < 0.01
    assert got["spinning"] > 0.0015, got  # the pool's worker still spins right after the run
