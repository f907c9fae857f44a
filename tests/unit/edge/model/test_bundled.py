"""The shipped models resolve by name; bundled-ee says where it comes from."""
from __future__ import annotations

import json

import pytest

from edge.model.bundled import BUNDLED_DIR, BUNDLED_EE_DIR, read_lineage, resolve_model
from edge.training.bundle_ee import quality_gate
from edge.model.checkpoint import load_decoder
from edge.core.errors import CheckpointError
from tests.images import assert_png, figure_size


def test_bundled_ee_is_the_bundled_architecture_with_a_lineage():
    assert resolve_model("bundled-ee") == BUNDLED_EE_DIR
    lineage = read_lineage(BUNDLED_EE_DIR)
    assert lineage["base_model"] == "bundled" and lineage["backbone_finetuned"] is True
    recipe, m = lineage["recipe"], lineage["metrics"]
    assert recipe["config"]["freeze_backbone"] is False and recipe["method"] == "layerskip"
    assert recipe["config"]["layerskip"]["enabled"] is True and len(recipe["layer_dropout_rates"]) == 12
    # Issue 8: what ships passed the full-depth quality gate, computed from the numbers beside it.
    assert m["quality_gate"] == quality_gate(m) and m["quality_gate"]["passed"]
    assert set(m["exit_agreement"]) == set(m["base_exit_agreement"]) == {str(k) for k in range(1, 13)}
    assert sum(m["oracle_exit_hist"].values()) == pytest.approx(1.0)
    assert m["oracle_mean_exit_layer"] < m["base_oracle_mean_exit_layer"]  # the point of the training
    assert load_decoder(BUNDLED_EE_DIR).cfg == load_decoder(BUNDLED_DIR).cfg
    assert read_lineage(BUNDLED_DIR) == {}
    card = (BUNDLED_EE_DIR / "MODEL_CARD.md").read_text()
    assert f"{m['heldout_ppl']:.3f}" in card and f"{m['base_heldout_ppl']:.3f}" in card
    for png in ("exit_losses.png", "exit_depth.png"):
        assert 0 < (BUNDLED_EE_DIR / png).stat().st_size < 100_000


def test_unknown_folder_and_bad_lineage(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "lineage.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_lineage(tmp_path)
    (tmp_path / "lineage.json").write_text(json.dumps({"base_model": "bundled"}))
    assert read_lineage(tmp_path)["base_model"] == "bundled"


def test_quality_gate_is_relative_and_one_sided():
    base = {"base_heldout_ppl": 20.0, "base_heldout_top1": 0.40}
    assert quality_gate({**base, "heldout_ppl": 20.19, "heldout_top1": 0.3961})["passed"]
    assert quality_gate({**base, "heldout_ppl": 18.0, "heldout_top1": 0.45})["passed"]  # better is fine
    assert not quality_gate({**base, "heldout_ppl": 20.21, "heldout_top1": 0.40})["passed"]
    assert not quality_gate({**base, "heldout_ppl": 20.0, "heldout_top1": 0.3959})["passed"]


def test_make_ee_from_a_layerskip_run_writes_lineage_card_and_plots(micro_run, tmp_path):
    from edge.training.bundle_ee import make_bundled_ee
    from edge.pipeline.cli import main as cli

    base = micro_run.parent / "model"  # 4 layers, random weights, own tokenizer
    run = tmp_path / "ls"
    assert cli(["distill", f"model={base}", f"run_dir={run}", "steps=2", "seq_len=32", "batch_size=2",
                "train_tokens=4000", "eval_windows=2", "exits.layers=[1,2,3,4]", "exits.adapter_rank=0",
                "freeze_backbone=false", "lr=2.0", "layerskip.enabled=true", "layerskip.p_max=0.2",
                "layerskip.curriculum=gradual"]) == 0
    ee = make_bundled_ee(run, tmp_path / "ee")
    lineage = read_lineage(ee)
    recipe, m = lineage["recipe"], lineage["metrics"]
    assert recipe["method"] == "layerskip" and recipe["steps"] == 2 and recipe["train_seconds"] > 0
    rates = recipe["layer_dropout_rates"]
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)
    assert set(m["exit_agreement"]) == set(m["base_exit_agreement"]) == {"1", "2", "3", "4"}
    assert sum(m["oracle_exit_hist"].values()) == pytest.approx(1.0)
    gate = m["quality_gate"]
    assert gate["ppl_rel_change"] == pytest.approx(m["heldout_ppl"] / m["base_heldout_ppl"] - 1)
    card = (ee / "MODEL_CARD.md").read_text()
    assert "LayerSkip" in card and f"{m['heldout_ppl']:.3f}" in card and "exit_depth.png" in card
    for png in ("exit_losses.png", "exit_depth.png"):
        assert (ee / png).stat().st_size < 100_000
    # edge/training/layerskip.py: 6.4 x 3.8 in at 90 dpi, one line per exit in viridis; two steps give
    # a line only for the last exit (the earlier ones are sampled one step each), its colour is viridis' last
    # edge/training/ee_card.py: 8 x 3.2 in at 80 dpi, base bars grey, bundled-ee bars blue
    assert_png(ee / "exit_losses.png", figure_size(6.4, 3.8, 90), colours=["#fde725"], min_pixels=200)
    assert_png(ee / "exit_depth.png", figure_size(8.0, 3.2, 80), colours=["#9aa5b1", "#2a6f97"])
    # Adam at lr 2 wrecks the decoder: full depth far past the gate, shipping it is refused, nothing written
    assert gate["ppl_rel_change"] > 0.01 and not gate["passed"]
    with pytest.raises(CheckpointError, match="quality gate"):
        make_bundled_ee(run, tmp_path / "refused", enforce_gate=True)
    assert not (tmp_path / "refused").exists()
