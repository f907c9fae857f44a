"""distill -> compress -> export -> calibrate -> bench compress -> report on the micro run: the served model
is the compressed one, its graphs carry Q/DQ, calibration runs them, the report has the compression section."""
from __future__ import annotations

import json
import shutil

import onnx
import pytest

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError
from edge.pipeline.cli import main as cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAST = ["qat_steps=3", "seq_len=32", "fit_tokens=6000", "calib_batches=1", "sensitivity_windows=2", "eval_windows=2",
        "extra_critical=1", "threads=1"]


@pytest.fixture(scope="module")
def run(micro_run, tmp_path_factory):
    run = tmp_path_factory.mktemp("compress") / "run"
    shutil.copytree(micro_run, run)
    return run


CALIBRATE = ["epsilon=0.2", "fit_units=16", "certify_units=32", "propagate_units=32", "eval_units=4", "prompt_tokens=16",
             "new_tokens=6", "batch=16", "threads=1"]


def test_compressed_model_is_what_every_later_stage_serves(run, capsys):
    assert cli(["compress", f"run_dir={run}", "recipe=int8_mixed_sparse", *FAST]) == 0
    # a compressed model is calibrated on the graphs that serve it: not before they exist
    assert cli(["calibrate", f"run_dir={run}", *CALIBRATE]) == 2
    assert "run `smartexit export" in capsys.readouterr().err
    m = Manifest(run)
    assert m.served_checkpoint() == run / "compressed"
    report = json.loads((run / "compress" / "report.json").read_text())
    assert report["metrics"]["model_bytes_ratio"] < 0.6
    assert report["metrics"]["data"] == {"fit": "train", "evaluate": "test"}
    assert set(report["sensitivity"]["feeds_exit"]) <= set(report["qat"]["trained_layers"])
    assert cli(["export", f"run_dir={run}", "prompt_tokens=16", "parity_prompts=2", "threads=1"]) == 0
    meta = json.loads((run / "onnx" / "graphs.json").read_text())
    from edge.core.artifacts import sha256_path
    assert meta["checkpoint_sha256"] == sha256_path(run / "compressed")
    fused = onnx.load(str(run / "onnx" / "fused" / "segment_0.onnx"))
    ops = {n.op_type for n in fused.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # INT8 Q/DQ in the graph ONNX Runtime runs
    portable = onnx.load(str(run / "onnx" / "segment_0.onnx"))
    assert "QuantizeLinear" in {n.op_type for n in portable.graph.node}  # and in the one TensorRT builds from
    assert cli(["calibrate", f"run_dir={run}", *CALIBRATE]) == 0
    table = json.loads((run / "calibration" / "thresholds.json").read_text())
    assert table["checkpoint_sha256"] == sha256_path(run / "compressed")
    cal = Manifest(run).stage("calibrate")
    assert cal["metrics"]["engine"] == "onnxruntime" and cal["metrics"]["reference"] == "onnxruntime, full-depth decode"
    assert "graphs" in cal["inputs"]  # a new export makes the table stale
    assert isinstance(cal["metrics"]["accuracy_float_model"], float)  # the model it was compressed from, found
    assert cli(["bench", "compress", f"run_dir={run}", "batch_sizes=[1,2]", "prompt_tokens=12", "new_tokens=4",
                "batch1_prompts=2", "repeats=1", "eval_windows=2", "false_exit_prompts=2", "llamacpp=false",
                "ti_windows=2", "ti_skip_from_layer=2", "threads=1"]) == 0
    bench = json.loads((run / "bench" / "compress.json").read_text())
    assert set(bench["rows"]) == {"none", "shipped"}
    assert bench["rows"]["shipped"]["precision"] == "w8a8" and bench["rows"]["none"]["precision"] == "fp32"
    assert bench["rows"]["shipped"]["parity_passed"] is True
    assert bench["rows"]["shipped"]["onnx_bytes"] < bench["rows"]["none"]["onnx_bytes"]
    assert bench["rows"]["none"]["full_depth_mismatch_vs_torch"] == 0.0  # float graphs decode what torch decodes
    assert 0.0 <= bench["rows"]["shipped"]["full_depth_mismatch_vs_torch"] <= 1.0
    float_export = sorted((run / "bench" / "float_onnx").rglob("*.onnx"))
    assert float_export  # bench compress exported the float model's graphs; bench energy reuses them
    mtimes = [p.stat().st_mtime_ns for p in float_export]
    assert cli(["bench", "energy", f"run_dir={run}", "meter=none", "idle_seconds=0.1", "prompts=2", "prompt_tokens=12",
                "new_tokens=4", "repeats=2", "threads=1"]) == 0
    assert [p.stat().st_mtime_ns for p in float_export] == mtimes
    energy = json.loads((run / "bench" / "energy.json").read_text())
    assert set(energy["rows"]) == {"full", "exits", "compressed_full", "compressed_exits", "served"}
    served = energy["summary"]  # the shipped graphs as served, against their own full depth
    assert served["served_full_depth"] == "compressed_full" and served["cpu_ratio_served_vs_full_depth"] > 0
    for row in energy["rows"].values():  # no sensor here: no joules, the CPU-time proxy measured
        assert row["joules_per_token"] is None and row["cpu_seconds_per_token"]["median"] > 0
        assert row["tokens"] == 2 * 2 * 4
    assert energy["summary"]["meter"] == "none" and energy["summary"]["ratio_exit_vs_full"] is None
    assert energy["summary"]["false_exit_tokens"] == 2 * 3  # 2 prompts x (4 - 1) judged tokens
    assert 0.0 <= energy["summary"]["false_exit_rate"] <= 1.0
    assert energy["summary"]["false_exits_judged_against"] == "onnxruntime, full-depth decode"
    assert "no power sensor" in (run / "bench" / "energy.md").read_text()
    assert cli(["report", f"run_dir={run}"]) == 0
    e = json.loads((run / "report.json").read_text())["energy"]
    assert e["joules_per_token"] == {n: None for n in energy["rows"]}
    assert set(e["cpu_seconds_per_token"]) == set(energy["rows"]) and "ratio_exit_vs_full" in e
    assert "## Energy per token" in (run / "report.md").read_text()
    c = json.loads((run / "report.json").read_text())["compression"]
    for key in ("accuracy_loss_rel", "model_bytes_ratio", "speedup_vs_fp32_b1", "false_exit_bound"):
        assert isinstance(c[key], float), key
    assert c["recipe"] == "int8_mixed_sparse"
    assert "## Compression" in (run / "report.md").read_text()
    # what a device serves without TensorRT engines: the compressed model on torch_static (eager on this CPU)
    assert cli(["bench", "energy", f"run_dir={run}", "meter=none", "idle_seconds=0", "prompts=2", "prompt_tokens=12",
                "new_tokens=4", "repeats=1", "threads=1", "backend=torch_static", "device=cpu"]) == 0
    energy = json.loads((run / "bench" / "energy.json").read_text())
    assert set(energy["rows"]) == {"full", "exits", "served"} and energy["summary"]["backend"] == "torch_static"
    assert energy["summary"]["served_full_depth"] == "full"  # the served model's own full depth on that backend
    assert energy["summary"]["full_is"] == "the served model on torch_static without an exit rule"
    assert all(row["tokens"] == 2 * 4 for row in energy["rows"].values())
    assert energy["summary"]["false_exits_judged_against"] == "torch_static, full-depth decode"
    assert "False exits of `exits`" in (run / "bench" / "energy.md").read_text()


def test_a_changed_distilled_checkpoint_invalidates_the_compressed_one(run):
    m = Manifest(run)
    rec = m.data["stages"]["compress"]["inputs"]["checkpoint"]
    rec["sha256"] = "0" * 64
    with pytest.raises(ArtifactError, match="re-run 'compress'"):
        m.served_checkpoint()
