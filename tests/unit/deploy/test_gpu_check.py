"""deploy/gpu_check.*: the script a session with a CUDA GPU runs, and its sections (edge/pipeline/gpu_check/).
Here: it compiles, its shell is clean, its decode step (run on CPU) gives the full model's greedy tokens, its
sections run eagerly on the CPU, and without CUDA it says so and exits 2."""
from __future__ import annotations

import json
import py_compile
import shutil
import subprocess
import sys

import pytest
import torch

from tests.unit.edge.jetson.jetson_identity import REPO

SCRIPT = REPO / "deploy" / "gpu_check.py"


def test_python_compiles_and_shell_is_clean():
    py_compile.compile(str(SCRIPT), doraise=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed here")
    res = subprocess.run(["shellcheck", str(REPO / "deploy" / "gpu_check.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_decode_step_matches_full_forward_greedy():
    """At full depth the cached decode step must give what re-running the whole sequence gives."""
    from edge.model.bundled import BUNDLED_EE_DIR
    from edge.model.checkpoint import load_decoder
    from edge.pipeline.gpu_check.torch_decode import run_decode

    if not (BUNDLED_EE_DIR / "model.safetensors").is_file():
        pytest.skip("the bundled model is not in this checkout")
    torch.set_num_threads(1)
    bb = load_decoder(BUNDLED_EE_DIR).eval()
    ids = torch.randint(0, bb.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    _, tokens = run_decode(bb, ids, 6, bb.cfg.num_layers, lambda: None)
    seq = ids
    with torch.no_grad():
        for _ in range(7):
            seq = torch.cat((seq, bb(seq).logits[:, -1:].argmax(-1)), dim=1)
    assert tokens == seq[:, 12:].tolist()
    _, early = run_decode(bb, ids, 6, 3, lambda: None)  # an exit runs (and differs, usually)
    assert len(early[0]) == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_it_says_so(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2
    assert "no CUDA GPU" in json.loads((tmp_path / "gpu_check.json").read_text())["skipped"]


def test_engine_section_runs_eagerly_on_the_cpu():
    """The engine timing of section 5, eager on the CPU (the GPU run adds the captured graphs): both rules
    decode and report their rates (timing itself is the GPU run's business, not a unit test's)."""
    from edge.pipeline.gpu_check.engine_runs import engine_runs
    from tests.unit.edge.runtime.test_engine import _model

    out = engine_runs(_model(), [1, 2], 8, 6, "float32", device="cpu")
    assert set(out) == {"1", "2"}
    for row in out.values():
        assert row["eager_full_decode_tokens_per_s"] > 0 and row["eager_exit_first_decode_tokens_per_s"] > 0
        assert row["eager_captured"] == 0


def test_exit_cost_section_runs_eagerly_on_the_cpu():
    """Section 6 on the CPU (eager, no meter, one short round): every rule decodes; the rule that never
    exits lets nothing leave and pays every check, the first-exit rule makes every token leave at the first
    exit; the candidate-shortlist twin of the never rule decodes too; the ratios are the rates' quotients.
    Timing is the GPU run's business."""
    from edge.pipeline.gpu_check.exit_costs import engine_exit_costs
    from tests.unit.edge.runtime.test_engine import _model

    model = _model()
    out = engine_exit_costs(model, [1, 2], 8, 6, "float32", window_s=0.0, rounds=1, device="cpu", shortlist=16)
    first, depth = model.exit_layers[0], model.backbone.cfg.num_layers
    for b in ("1", "2"):
        row = out[b]
        assert row["full"]["left_early"] == 0 and row["never"]["left_early"] == 0  # full: requests in mode full
        assert row["never_shortlist"]["left_early"] == 0 and "extra_ms_per_step_per_check_shortlist" in row
        assert row["never_pipelined"]["left_early"] == 0 and "extra_ms_per_step_per_check_shortlist_pipelined" in row
        assert row["exit_first_pipelined"]["mean_exit_layer"] == first
        assert row["never"]["mean_exit_layer"] == depth
        assert row["exit_first"]["left_early"] == 1 and row["exit_first"]["mean_exit_layer"] == first
        rates = row["never"]["decode_tokens_per_s"], row["full"]["decode_tokens_per_s"]
        assert row["speedup_vs_full"]["never"] == rates[0] / rates[1]
        assert row["full"]["joules_per_token"] is None and "layer_ms_graph_replay" not in row  # no meter, no graphs
    assert out["captured"] == 0
    assert out["wasted_segments_pipelined"] > 0  # every token left at the first exit with the next segment ahead


def test_realistic_exit_section_runs_eagerly_on_the_cpu():
    """Section 7 on the CPU (eager, no meter, one short round, 4 real-text prompts): the threshold lets
    tokens leave early (and not all of them), pipelined and not the same tokens leave, and the backend
    launched ahead wasted segments where they did."""
    from edge.model.bundled import BUNDLED_EE_DIR
    from edge.model.checkpoint import load_decoder
    from edge.pipeline.gpu_check.realistic_exits import realistic_exits

    if not (BUNDLED_EE_DIR / "model.safetensors").is_file():
        pytest.skip("the bundled model is not in this checkout")
    torch.set_num_threads(1)
    bb = load_decoder(BUNDLED_EE_DIR).eval()
    out = realistic_exits(bb, [1, 2], 8, "float32", window_s=0.0, rounds=1, device="cpu", prompts_n=4,
                          prompt_tokens=32, leave=0.5)
    assert out["prompts"] == 4 and out["exit_layers"] == [1, 2, 4, bb.cfg.num_layers]
    for b in ("1", "2"):
        row = out[b]
        assert row["full"]["left_early"] == 0
        assert 0 < row["rule"]["left_early"] < 1
        assert row["rule_pipelined"]["left_early"] == row["rule"]["left_early"]
        assert row["rule_pipelined"]["mean_exit_layer"] == row["rule"]["mean_exit_layer"]
        assert row["wasted_segments_pipelined"] > 0


def test_projection_section_runs_eagerly_on_the_cpu():
    """Section 8 on the CPU at the micro shape (eager, bf16, one short round): full depth, every check paid,
    every token forced out at each exit, pipelined or not; the projected speed-up is projection_replay.py's
    formula over those step times (recomputed here), and the exits are the replay moved to the shape."""
    from edge.pipeline.bench.projection_replay import DEFAULT_RUN, projected_speedup, scale_distribution
    from edge.pipeline.bench.projection_shapes import shape_config
    from edge.pipeline.gpu_check.projection import projection_on_gpu

    torch.set_num_threads(1)
    out = projection_on_gpu(["micro"], 4, window_s=0.0, rounds=1, prompt=8, device="cpu")
    cfg = shape_config("micro")
    tokens = sum(DEFAULT_RUN["counts"].values())
    fraction = scale_distribution({k: v / tokens for k, v in DEFAULT_RUN["counts"].items()},
                                  DEFAULT_RUN["num_layers"], cfg.num_layers)
    row = out["micro"]
    assert row["exit_fraction"] == fraction
    exits = sorted(k for k in fraction if k < cfg.num_layers)
    ms = row["1"]["ms_per_step"]
    forced = {f"leave_{k}{n}" for k in exits for n in ("", "_pipelined")}
    assert set(ms) == {"full", "never", "never_pipelined", *forced}
    step = {k: ms[f"leave_{k}"] for k in exits} | {cfg.num_layers: ms["never"]}
    assert row["1"]["projected_speedup"] == projected_speedup(ms["full"], step, fraction)
    assert all(row["1"]["mean_exit_layer"][f"leave_{k}{n}"] == k for k in exits for n in ("", "_pipelined"))
    assert row["1"]["mean_exit_layer"]["never"] == cfg.num_layers
    assert set(row["16"]["ms_per_step"]) == {"full", "never", "never_pipelined"}
