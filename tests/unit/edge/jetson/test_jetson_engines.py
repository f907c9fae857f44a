"""`smartexit jetson engines`: per-graph precision (INT8 only with Q/DQ, never FP8), profiles from the serving
config, the dry run off the device, and a whole run on a device root with a stand-in trtexec."""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from edge.core.artifacts import Manifest
from edge.jetson import engines as eng
from edge.jetson.engines import JetsonEnginesConfig, Limits, build_script, engine_jobs, precision_for
from edge.jetson.record import PARITY_DIR, record_parity
from edge.pipeline.cli import main as cli
from exporters.tensorrt import graph_features
from tests.unit.edge.jetson.conftest import device_root

# Stands in for JetPack's trtexec, reading the flags the real one takes (trtexec --help, TensorRT 10):
# --saveEngine writes a plan; --loadEngine/--loadInputs/--exportOutput writes, in trtexec's JSON layout,
# the recorded ONNX Runtime outputs of the graph whose inputs it was given (a perfect engine), each value
# scaled by $FAKE_TRT_SCALE (1: exact). It prints the version line the real one prints.
FAKE_TRTEXEC = """#!{python}
import json, os, sys
from pathlib import Path
import numpy as np
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
print("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # trtexec " + " ".join(sys.argv[1:]))
print("[I] TensorRT version: 10.3.0")
if "saveEngine" in args:
    Path(args["saveEngine"]).write_bytes(b"plan of " + Path(args["onnx"]).read_bytes()[:64])
    sys.exit(0)
first = args["loadInputs"].split(",")[0].split(":", 1)[1]
graph_dir = Path(first).parent
items = []
for npy in sorted(graph_dir.glob("*.npy")):
    arr = np.load(npy) * float(os.environ.get("FAKE_TRT_SCALE", "1"))
    items.append({{"name": npy.stem, "dimensions": "x".join(map(str, arr.shape)),
                  "values": [float(v) for v in arr.reshape(-1)]}})
Path(args["exportOutput"]).write_text(json.dumps(items))
"""


@pytest.fixture
def fake_trtexec(tmp_path) -> Path:
    path = tmp_path / "trtexec"
    path.write_text(FAKE_TRTEXEC.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def pushed(run_dir) -> Path:
    """The run as it lands on the device: with the parity recording made at push time."""
    record_parity(run_dir / "onnx", run_dir / PARITY_DIR)
    return run_dir


def _graph(path: Path, qdq: bool) -> None:
    """A tiny MatMul graph, with an explicit Q/DQ pair on its input when ``qdq`` (a compressed export's shape)."""
    x = helper.make_tensor_value_info("exit_hidden", TensorProto.FLOAT, ["batch", 1, 4])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, 3])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], [0.1] * 12)
    nodes, inp, inits = [], "exit_hidden", [w]
    if qdq:
        inits += [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]), helper.make_tensor("z", TensorProto.INT8, [], [0])]
        nodes += [helper.make_node("QuantizeLinear", ["exit_hidden", "s", "z"], ["q"]),
                  helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"])]
        inp = "dq"
    nodes.append(helper.make_node("MatMul", [inp, "w"], ["logits"]))
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits)), path)


def test_int8_only_where_the_graph_carries_qdq(tmp_path):
    _graph(tmp_path / "head.onnx", qdq=True)
    _graph(tmp_path / "plain.onnx", qdq=False)
    assert precision_for(graph_features(tmp_path / "head.onnx")).value == "int8"
    assert precision_for(graph_features(tmp_path / "plain.onnx")).value == "fp16"
    meta = {"model": {"hidden_size": 4, "max_positions": 64},
            "graphs": {"head": {"file": "head.onnx", "inputs": ["exit_hidden"]}}}
    (job,) = engine_jobs(tmp_path, tmp_path / "e", meta, Limits(8, 16, 64), JetsonEnginesConfig())
    assert "--int8" in job.argv and "--fp16" in job.argv and not any("fp8" in a for a in job.argv)
    assert "--maxShapes=exit_hidden:8x1x4" in job.argv  # the serving batch limit
    meta["graphs"]["head"]["file"] = "plain.onnx"
    (job,) = engine_jobs(tmp_path, tmp_path / "e", meta, Limits(8, 16, 64), JetsonEnginesConfig())
    assert "--fp16" in job.argv and "--int8" not in job.argv


def test_profiles_come_from_the_serving_config(pushed):
    m = Manifest(pushed)
    meta = json.loads((pushed / "onnx" / "graphs.json").read_text())
    limits = eng.serving_limits(m, meta)
    assert limits == Limits(max_batch=4, max_chunk=8, context=128)  # repo: max_seqs 4, prefill_budget 8
    jobs = {j.graph: j for j in engine_jobs(pushed / "onnx", pushed / "e", meta, limits, JetsonEnginesConfig())}
    seg = jobs["segment_1"].argv
    assert "--minShapes=hidden:1x1x64,positions:1x1,attn_mask:1x1x1x1,past_key_2:1x2x0x16" in ",".join(seg)
    assert any(a.startswith("--maxShapes=hidden:4x8x64,positions:4x8,attn_mask:4x1x8x136,past_key_2:4x2x128x16")
               for a in seg)
    assert all(j.precision.value == "fp16" for j in jobs.values())  # a float export: no Q/DQ anywhere


def test_dry_run_off_device(pushed, capsys):
    rc = cli(["jetson", "engines", f"run_dir={pushed}", "dry_run=true"])
    out = capsys.readouterr().out
    assert rc == 0 and "a real run here stops with exit code 2" in out
    cmds = [shlex.split(line) for line in out.splitlines() if line.startswith("/usr/src/tensorrt/bin/trtexec")]
    builds = [c for c in cmds if any(a.startswith("--saveEngine=") for a in c)]
    checks = [c for c in cmds if any(a.startswith("--loadEngine=") for a in c)]
    assert [c[1] for c in builds] == [f"--onnx={pushed}/onnx/{g}.onnx" for g in
                                      ("embed", "segment_0", "segment_1", "kvfill_1", "head")]
    assert all(f"--timingCacheFile={pushed}/jetson/engines/timing.cache" in c for c in builds)
    head = next(c for c in checks if c[1] == f"--loadEngine={pushed}/jetson/engines/head.plan")
    assert head[2:] == ["--shapes=exit_hidden:2x1x64",
                        f"--loadInputs=exit_hidden:{pushed}/jetson/parity/head/exit_hidden.bin",
                        f"--exportOutput={pushed}/jetson/device/parity/head.json",
                        "--iterations=1", "--warmUp=0", "--duration=0"]
    assert not (pushed / "jetson" / "engines").exists() and not (pushed / "jetson" / "device").exists()


def test_real_run_refused_off_device(pushed, capsys):
    assert cli(["jetson", "engines", f"run_dir={pushed}"]) == 2
    assert "not a Jetson" in capsys.readouterr().err


def test_on_a_device_builds_then_checks_parity(pushed, tmp_path, fake_trtexec, capsys):
    root = device_root(tmp_path / "root")
    cfg = JetsonEnginesConfig(run_dir=str(pushed), root=str(root), trtexec=str(fake_trtexec))
    assert eng.main(cfg) == 0
    out = capsys.readouterr().out
    parity = json.loads((pushed / "jetson/device/parity.json").read_text())
    assert parity["passed"] and set(parity["graphs"]) == {"embed", "segment_0", "segment_1", "kvfill_1", "head"}
    head = parity["graphs"]["head"]
    assert head["argmax_agree"] == head["argmax_rows"] and len(head["outputs"]) == 3  # logits, exit_stats, exit_token
    info = json.loads((pushed / "jetson/engines/engines.json").read_text())
    assert info["tensorrt"] == "10.3.0" and info["engines"]["segment_0"]["precision"] == "fp16"
    stage = Manifest(pushed).stage("jetson_engines")
    assert stage["metrics"]["parity_passed"] is True and "parity head" in out
    assert eng.main(cfg) == 0  # nothing changed: no rebuild
    assert capsys.readouterr().out.count("is up to date") == 5


def test_parity_failure_exits_1(pushed, tmp_path, fake_trtexec, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_TRT_SCALE", "1.5")  # every output 50% off: a broken engine
    root = device_root(tmp_path / "root")
    rc = eng.main(JetsonEnginesConfig(run_dir=str(pushed), root=str(root), trtexec=str(fake_trtexec)))
    assert rc == 1 and "FAILED" in capsys.readouterr().out
    assert json.loads((pushed / "jetson/device/parity.json").read_text())["passed"] is False


def test_recording_of_another_export_is_refused(pushed, tmp_path, fake_trtexec):
    info_path = pushed / PARITY_DIR / "parity_inputs.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "graphs_sha256": "0" * 64}))
    root = device_root(tmp_path / "root")
    assert cli(["jetson", "engines", f"run_dir={pushed}", f"root={root}", f"trtexec={fake_trtexec}"]) == 2


def test_build_script_is_clean_shell(pushed, tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed here")
    meta = json.loads((pushed / "onnx" / "graphs.json").read_text())
    jobs = engine_jobs(pushed / "onnx", pushed / "e", meta, Limits(4, 8, 128), JetsonEnginesConfig())
    script = tmp_path / "build_engines.sh"
    script.write_text(build_script(jobs))
    res = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
