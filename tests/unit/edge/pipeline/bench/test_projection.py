"""The projection benchmark: exit layers and distributions moved by relative depth (by hand), the speed-up
arithmetic on hand-made chain times, the replay read from a run, bad input, and the whole path on the
micro shape (fields present and finite; no timing is asserted: speed is measured, not tested)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError, ConfigError
from edge.pipeline.bench.projection import STAGE, ProjectionBenchConfig, main
from edge.pipeline.bench.projection_figures import shape_figures
from edge.pipeline.bench.projection_replay import (Replay, projected_speedup, read_replay, replay_at,
                                                   scale_distribution, scale_layer)
from edge.pipeline.bench.projection_shapes import shape_config

SHIPPED = {1: 0.1, 2: 0.05, 3: 0.05, 4: 0.1, 6: 0.05, 8: 0.05, 12: 0.6}  # exits of a 12-layer model


@pytest.mark.parametrize("k,n,layers,expected", [
    (1, 12, 24, 2), (6, 12, 24, 12), (12, 12, 24, 24),
    (1, 12, 16, 1), (2, 12, 16, 3), (3, 12, 16, 4), (4, 12, 16, 5), (6, 12, 16, 8), (8, 12, 16, 11), (12, 12, 16, 16),
    (3, 12, 6, 2),  # 1.5: halves go up
    (1, 12, 4, 1),  # 0.33 -> 0: no exit before the first layer
    (12, 12, 12, 12),
])
def test_scale_layer(k, n, layers, expected):
    assert scale_layer(k, n, layers) == expected


def test_scale_distribution_moves_and_merges():
    # to 16 layers no two exits land together: [1, 3, 4, 5, 8, 11, 16]
    assert scale_distribution(SHIPPED, 12, 16) == pytest.approx(
        {1: 0.1, 3: 0.05, 4: 0.05, 5: 0.1, 8: 0.05, 11: 0.05, 16: 0.6}, rel=1e-12)
    # to 4 layers exits 1, 2, 3 and 4 all land on layer 1 (0.33 -> 0 is raised to 1), 6 on 2, 8 on 3 (2.67)
    assert scale_distribution(SHIPPED, 12, 4) == pytest.approx({1: 0.3, 2: 0.05, 3: 0.05, 4: 0.6}, rel=1e-12)
    # the last layer is always an exit of the target, with whatever fraction reaches it
    assert scale_distribution({1: 1.0}, 12, 24) == {2: 1.0, 24: 0.0}


@pytest.mark.parametrize("fraction,msg", [
    ({1: 0.5, 12: 0.4}, "sum to 0.9"),
    ({1: 0.5, 13: 0.5}, r"layers \[13\] are outside"),
    ({1: 1.2, 12: -0.2}, "negative"),
])
def test_bad_distributions(fraction, msg):
    with pytest.raises(ConfigError, match=msg):
        scale_distribution(fraction, 12, 24)
    with pytest.raises(ConfigError, match=msg):
        Replay("test", 12, fraction, 32, "defer")


def test_projected_speedup_by_hand():
    # half the steps leave at 1 (2 ms), a quarter at 2 (4 ms), a quarter run everything (11 ms): 4.75 ms a step
    assert projected_speedup(10.0, {1: 2.0, 2: 4.0, 4: 11.0}, {1: 0.5, 2: 0.25, 4: 0.25}) == pytest.approx(10 / 4.75)


def test_shape_figures_from_chain_times():
    # 4 layers of 1 ms, a head of 2 ms, exits at 2 and 4 (2 segments: one check point, one boundary);
    # repeat 0: the check adds 0.1 ms and the boundary 0.2 ms; repeat 1 runs 10 % slower throughout
    r0 = {"full": 6.0, "split": 6.2, "checks": 6.3, "head": 2.0, "exit_2": 2.1}
    chains = {k: [v, 1.1 * v] for k, v in r0.items()}
    f = shape_figures({"1": chains, "16": {k: v for k, v in chains.items() if k != "exit_2"}},
                      {2: 0.5, 4: 0.5}, 4, 96)
    assert f["exit_layers"] == [2, 4] and f["mean_exit_layer"] == 3.0 and f["layers_skipped_frac"] == 0.25
    med = {k: 1.05 * v for k, v in r0.items()}  # the median of two repeats is their mean
    layer = (med["full"] - med["head"]) / 4
    assert f["layer_ms"] == pytest.approx(layer, rel=1e-12)
    assert f["decision_cost_layers"] == pytest.approx(0.1 / 1.0, rel=1e-9)  # scale-free: 0.1 ms of 1 ms layers
    assert f["boundary_layers"] == pytest.approx(0.2, rel=1e-9)
    assert f["head_layers"] == pytest.approx(2.0, rel=1e-9)
    assert f["speedup_exit_vs_full_b1"] == pytest.approx(6.0 / (0.5 * 2.1 + 0.5 * 6.3), rel=1e-9)
    assert f["speedup_exit_vs_split_b1"] == pytest.approx(6.2 / (0.5 * 2.1 + 0.5 * 6.3), rel=1e-9)
    assert f["speedup_layers_only"] == pytest.approx(4 / 3)
    # the repeats differ by a common factor: every ratio is the same in both, only the times spread
    assert f["spread_b1"]["speedup_exit_vs_full_b1"]["min"] == pytest.approx(f["speedup_exit_vs_full_b1"], rel=1e-9)
    assert f["spread_b1"]["layer_ms"] == pytest.approx({"min": 1.0, "max": 1.1}, rel=1e-9)
    assert set(f["decision_cost"]) == {"1", "16"}


def test_bad_configs():
    with pytest.raises(ConfigError, match="unknown shape 'gpt5'; known: qwen2_0_5b, llama3_1b"):
        ProjectionBenchConfig(shapes=["gpt5"])
    with pytest.raises(ConfigError, match="unknown shape"):
        shape_config("gpt5")
    with pytest.raises(ConfigError, match="include 1"):
        ProjectionBenchConfig(batch_sizes=[16])
    with pytest.raises(ConfigError, match="beyond shape micro's 128 positions"):
        ProjectionBenchConfig(shapes=["micro"], past=200)
    with pytest.raises(ConfigError, match="exceeds shape micro's vocabulary"):
        replay_at("micro", Replay("test", 12, SHIPPED, 1024, "defer"))


def test_shapes_are_the_published_ones():
    q, ll = shape_config("qwen2_0_5b"), shape_config("llama3_1b")
    assert (q.num_layers, q.hidden_size, q.num_kv_heads, q.head_dim, q.qkv_bias) == (24, 896, 2, 64, True)
    assert (ll.num_layers, ll.hidden_size, ll.num_kv_heads, ll.head_dim, ll.qkv_bias) == (16, 2048, 8, 64, False)
    # Qwen2.5-0.5B: 494M parameters; Llama-3.2-1B: 1.24B (tied embeddings, counted once)
    assert q.num_params() == pytest.approx(494.0e6, rel=0.01)
    assert ll.num_params() == pytest.approx(1.236e9, rel=0.01)


def _calibrated_run(root: Path, fraction: dict[int, float], shortlist: int = 32) -> Path:
    """A run folder whose manifest holds a distilled checkpoint (only its exits.json) and calibrate's metrics."""
    run = root / "run"
    ckpt = run / "multi_exit"
    ckpt.mkdir(parents=True)
    (ckpt / "exits.json").write_text(json.dumps({"exit_layers": sorted(SHIPPED), "num_layers": 12,
                                                 "exits": {"layers": sorted(SHIPPED), "shortlist": shortlist}}))
    m = Manifest(run)
    m.record("distill", inputs={}, config={}, outputs={"checkpoint": ckpt}, metrics={}, seconds=0.0)
    m.record("calibrate", inputs={}, config={}, outputs={}, seconds=0.0, metrics={
        "kv_mode": "defer", "free_run": {"exited_frac": 0.3, "mean_exit_layer": 9.5},
        "certify_walk": {"exit_fraction": {str(k): v for k, v in fraction.items()}, "n_tokens": 100, "lambda": 0.9}})
    return run


def test_read_replay_from_a_run_and_the_default(tmp_path):
    r = read_replay(_calibrated_run(tmp_path, SHIPPED))
    assert (r.num_layers, r.shortlist, r.kv_mode, r.fraction) == (12, 32, "defer", SHIPPED)
    assert r.free_run == {"exited_frac": 0.3, "mean_exit_layer": 9.5} and r.checkpoint.endswith("multi_exit")
    d = read_replay(tmp_path / "nothing-here")
    assert d.source.startswith("default (no calibrated run") and d.checkpoint is None
    assert math.fsum(d.fraction.values()) == pytest.approx(1.0, rel=1e-12)


def test_read_replay_refuses_a_distribution_off_the_exits(tmp_path):
    with pytest.raises(ConfigError, match=r"layers \[5\] that are not exits"):
        read_replay(_calibrated_run(tmp_path, {5: 0.4, 12: 0.6}))


def test_read_replay_names_a_missing_metric(tmp_path):
    run = _calibrated_run(tmp_path, SHIPPED)
    m = Manifest(run)
    del m.data["stages"]["calibrate"]["metrics"]["certify_walk"]
    m.record("calibrate", inputs={}, config={}, outputs={}, seconds=0.0, metrics=m.data["stages"]["calibrate"]["metrics"])
    with pytest.raises(ArtifactError, match="calibrate's metrics have no 'certify_walk'; re-run calibrate"):
        read_replay(run)


def test_the_whole_path_on_the_micro_shape(tmp_path, capsys):
    run = _calibrated_run(tmp_path, SHIPPED)
    cfg = ProjectionBenchConfig(run_dir=str(run), shapes=["micro"], batch_sizes=[1, 2], past=16, calls=2, repeats=2)
    assert main(cfg) == 0
    out = json.loads((run / "bench" / "projection.json").read_text())
    assert out["kind"] == "projection" and any("never chooses" in c for c in out["caveats"])
    assert out["replay"]["kv_mode"] == "defer" and "does not time" in " ".join(out["caveats"])
    s = out["shapes"]["micro"]
    assert s["exit_layers"] == [1, 2, 3, 4] and s["model"]["shortlist"] == 32
    assert sum(s["exit_fraction"].values()) == pytest.approx(1.0, rel=1e-12)
    for key in ("layer_ms", "speedup_exit_vs_full_b1", "speedup_exit_vs_split_b1", "head_layers", "check_bytes_layers", "export_s"):
        assert math.isfinite(s[key]) and s[key] > 0, key
    # differences of two measured chains: finite, of either sign within the noise
    assert math.isfinite(s["decision_cost_layers"]) and math.isfinite(s["boundary_layers"])
    assert set(s["decision_cost"]) == {"1", "2"} and set(s["exit_ms_b1"]) == {"1", "2", "3", "4"}
    assert all(len(v) == 2 and min(v) > 0 for v in s["chain_ms"]["1"].values())
    # mode exact's verification: k rows per sequence over one, at batch 1 (graph of every layer) and 4 (verify graph)
    assert set(s["verify_cost_ratio"]) == {"1", "4"} and s["verify_cost_ratio"]["4"]["1"] == 1.0
    assert all(math.isfinite(v) and v > 0 for r in s["verify_cost_ratio"].values() for v in r.values())
    assert s["verify_cost_ratio_k4_b4"] == s["verify_cost_ratio"]["4"]["4"]
    c = out["conditions"]
    assert (c["threads"], c["repeats"], c["calls"], c["past"], c["dtype"]) == (2, 2, 2, 16, "float32")
    md = (run / "bench" / "projection.md").read_text()
    assert "a projection" in md and "the run's held-out free run: 0.300 and 9.50" in md
    assert "- micro: batch 1 (plain step" in md and "batch 4 (plain step" in md
    assert not (run / "bench" / "projection_graphs").exists()  # keep_graphs false
    rec = Manifest(run).stage(STAGE)
    assert rec["metrics"]["kind"] == "projection" and "checkpoint" in rec["inputs"]
    assert rec["metrics"]["micro"]["verify_cost_ratio_k4_b4"] == s["verify_cost_ratio_k4_b4"]
    from edge.pipeline.report_decode_md import projection_md  # the run's report carries the projection
    from edge.pipeline.report_sections import SECTIONS
    stage, section = SECTIONS["projection"]
    assert stage == STAGE and section(Manifest(run))["micro"]["exit_layers"] == [1, 2, 3, 4]
    assert any(line.startswith("- micro: exits [1, 2, 3, 4]") for line in projection_md(section(Manifest(run))))


def test_decision_cost_keeps_its_interface(tmp_path):
    """decision.py's pieces serve the projection; decision_cost itself still measures an export."""
    import torch

    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel
    from edge.model.segments import segment_layers
    from edge.pipeline.bench.decision import DecisionCost, decision_cost
    from exporters.ort_fused import build_fused, save_fused

    dec = Decoder(shape_config("micro"))
    dec.init_weights(0)
    model = MultiExitModel(dec, ExitConfig(layers=[2, 4], adapter_rank=0, shortlist=32)).eval()
    with torch.no_grad():
        save_fused(build_fused(model, segment_layers(model.exit_layers)), tmp_path)
    cost = decision_cost(model, tmp_path, 1, 16, 2, calls=2, repeats=2)
    assert isinstance(cost, DecisionCost) and cost.batch == 1 and cost.past == 16
    assert all(math.isfinite(v) for v in cost.to_dict().values()) and cost.layer_ms > 0


def test_chain_times_spreads_repeats_over_sessions_opened_in_both_orders(tmp_path, monkeypatch):
    """builds > 1: the sessions are opened afresh per build, the chains in reversed order every other build
    (where a session sits moves its speed), and the repeats are split between the builds, none lost."""
    import torch

    from edge.model.decoder import Decoder
    from edge.model.exits import ExitConfig, MultiExitModel
    from edge.model.segments import segment_layers
    from edge.pipeline.bench import decision
    from exporters.ort_fused import build_fused, save_fused

    dec = Decoder(shape_config("micro"))
    dec.init_weights(0)
    model = MultiExitModel(dec, ExitConfig(layers=[2, 4], adapter_rank=0, shortlist=32)).eval()
    with torch.no_grad():
        save_fused(build_fused(model, segment_layers(model.exit_layers)), tmp_path)
    opened = []
    real = decision.open_session
    monkeypatch.setattr(decision, "open_session", lambda ort, path, *a, **k: opened.append(path.name) or real(ort, path, *a, **k))
    chains = {"full": [tmp_path / "full.onnx", tmp_path / "head.onnx"], "head": [tmp_path / "head.onnx"]}
    times = decision.chain_times(chains, model.backbone.cfg, 1, 16, 1, calls=2, repeats=5, by_call=True, builds=3)
    assert {k: len(v) for k, v in times.items()} == {"full": 5, "head": 5}
    assert opened == ["full.onnx", "head.onnx", "head.onnx", "full.onnx", "full.onnx", "head.onnx"]
    with pytest.raises(ConfigError, match="builds"):
        decision.chain_times(chains, model.backbone.cfg, 1, 16, 1, calls=2, repeats=2, builds=0)
