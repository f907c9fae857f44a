"""Every stage on a small random model: export gate, calibrate, decode benchmark, report."""
from __future__ import annotations

import json
import shutil

import pytest

from edge.pipeline.bench.summary import SYSTEMS
from edge.pipeline.cli import main as cli
from tests.images import assert_calibration_plots, assert_png, figure_size

TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf"]  # matplotlib's default colour cycle

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(micro_run, tmp_path_factory):
    run = tmp_path_factory.mktemp("pipeline") / "run"
    shutil.copytree(micro_run, run)
    return run


def test_failing_parity_gate_stops_with_numbers(run, capsys):
    assert cli(["export", f"run_dir={run}", "atol=0", "rtol=0", "prompt_tokens=16", "parity_prompts=2"]) == 2
    err = capsys.readouterr().err
    assert "ONNX parity failed" in err and "largest max abs diffs" in err
    assert not (run / "onnx").exists()
    assert "export" not in json.loads((run / "manifest.json").read_text())["stages"]


def test_export_calibrate_bench_report(run):
    assert cli(["export", f"run_dir={run}", "prompt_tokens=16", "parity_prompts=2", "threads=1"]) == 0
    assert (run / "onnx" / "graphs.json").is_file()
    assert cli(["calibrate", f"run_dir={run}", "epsilon=0.2", "fit_units=16", "certify_units=32", "propagate_units=32",
                "eval_units=4", "prompt_tokens=16", "new_tokens=6", "batch=16", "threads=1"]) == 0
    assert_calibration_plots(run)
    assert cli(["bench", "decode", f"run_dir={run}", "batch_sizes=[1,2]", "prompt_tokens=16", "new_tokens=6",
                "repeats=1", "warmup=0", "layerskip_exit=2", "memory=false", "threads=1", "spec_extra_pairs=2"]) == 0
    assert cli(["report", f"run_dir={run}"]) == 0
    report = json.loads((run / "report.json").read_text())
    bench = report["decode_bench"]
    for key in ("speedup_exit_vs_full_b1", "speedup_exit_vs_hf_b1", "speedup_exit_vs_layerskip_b1",
                "speedup_exit_gated_vs_full_b1", "gate_share_checked_b1", "false_exit_rate"):
        assert isinstance(bench[key], float), key
    assert bench["batches"]["1"]["full_engine_equals_hf"] is True
    # (e)/(c): the row's one repeat and the two extra pairs of (e) and (c) alone, all compared token for token
    assert [bench["batches"][b]["speculative_pairs"] for b in ("1", "2")] == [3, 3]
    assert bench["batches"]["2"]["speculative_tokens_compared"] == 3 * 2 * 6
    assert set(bench["goals"]) >= {"speedup_exit_vs_full_b1", "false_exit_rate"}
    assert report["export"]["parity_passed"] is True
    # the throughput chart (edge/pipeline/bench/summary.py: 7 x 3.8 in at 110 dpi) has a bar, in its
    # system's colour of matplotlib's default cycle, for every system that measured a throughput
    results = json.loads((run / "bench" / "decode.json").read_text())
    measured = [k for k, s in enumerate(SYSTEMS)
                if any(b["systems"].get(s, {}).get("tokens_per_s", 0) > 0 for b in results["batches"].values())]
    assert measured, "no system measured a throughput"
    assert_png(run / "bench" / "decode.png", figure_size(7, 3.8, 110), colours=[TAB10[k] for k in measured])
