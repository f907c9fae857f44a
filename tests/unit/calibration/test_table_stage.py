"""Threshold table (hash binding, raw-score rule) and the calibrate stage's error handling."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from calibration.calibrators import Calibrator, CalibratorKind, fit_calibrators
from calibration.collect import collect
from calibration.risk import cascade
from calibration.signals import exit_targets
from calibration.table import TableRule, ThresholdTable, load_table
from edge.artifacts import sha256_path
from edge.cli import main as cli
from edge.errors import ArtifactError, CheckpointError
from edge.exits import exit_decision_stats, load_multi_exit


@pytest.mark.parametrize("kind", list(CalibratorKind))
def test_score_threshold_is_the_same_decision(kind):
    rng = np.random.default_rng(0)
    X = rng.uniform(0, 1, size=(3000, 6))
    y = (rng.uniform(size=3000) < 0.3 + 0.6 * X[:, 0]).astype(int)
    cal = Calibrator(kind=kind).fit(X, y)
    Xt = rng.uniform(0, 1, size=(2000, 6))
    p, s = cal.predict(Xt), cal.score(Xt)
    for lam in (0.2, 0.5, 0.7, 0.85, 0.95):
        t = cal.score_threshold(lam)
        disagree = (p >= lam) != (s >= t)
        # a token exactly at the crossing may round either way
        assert disagree.sum() <= 1, (lam, disagree.sum())
    w, b = cal.linear_score()  # the runtime form: one dot product
    assert np.allclose(Xt @ w + b, s, rtol=1e-12, atol=1e-9)


def _table_for(run, lam=0.6):
    ckpt = run / "multi_exit"
    model = load_multi_exit(ckpt)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.backbone.cfg.vocab_size, 2000).astype(np.uint16)
    data = collect(model, tokens, 32, 1024)
    cals = fit_calibrators(data.signals, exit_targets(data.argmax), CalibratorKind.PLATT)
    table = ThresholdTable(sha256_path(ckpt), model.exit_layers, "platt", lam,
                           {k: c.score_threshold(lam) for k, c in cals.items()}, cals, {"epsilon": 0.1})
    return model, data, cals, table, tokens


def test_table_roundtrip_and_hash_binding(micro_run, tmp_path):
    _, _, _, table, _ = _table_for(micro_run)
    path = tmp_path / "thresholds.json"
    table.save(path)
    loaded = load_table(path, micro_run / "multi_exit")
    assert loaded.score_thresholds == pytest.approx(table.score_thresholds)
    other = tmp_path / "other_ckpt"
    shutil.copytree(micro_run / "multi_exit", other)
    meta = json.loads((other / "exits.json").read_text())
    meta["metrics"]["tampered"] = True
    (other / "exits.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError) as err:
        load_table(path, other)
    assert table.checkpoint_sha256 in str(err.value) and sha256_path(other) in str(err.value)


@torch.no_grad()
def test_runtime_rule_matches_teacher_forced_cascade(micro_run):
    model, data, cals, table, tokens = _table_for(micro_run, lam=0.5)
    probs = {k: c.predict(data.signals[k]) for k, c in cals.items()}
    expected = cascade(probs, table.lam, data.final)
    assert len(set(expected.tolist())) > 1, "the test needs tokens exiting at different depths"
    rule = TableRule(table)
    w = torch.from_numpy(tokens[:33].astype(np.int64)).unsqueeze(0)
    out = model.backbone(w[:, :-1])
    batched = np.full(32, data.final)  # the engine's form: all 32 tokens at once, from graph statistics
    running = np.ones(32, bool)
    stats, toks, hid = {}, {}, {}
    for k in model.exit_layers[:-1]:
        hidden = model.exit_hidden(k, out.hidden_states[k])[0]  # [32, D]
        s, a = exit_decision_stats(torch.nn.functional.linear(hidden, model.backbone.head_weight))
        stats[k], toks[k], hid[k] = s.numpy(), a.numpy(), hidden.numpy()
        stop = rule.decide(k, stats, toks, hid) & running
        batched[stop] = k
        running &= ~stop
    assert np.array_equal(batched, expected[:32])
    for t in range(32):
        rule.reset()
        got = data.final
        for k in model.exit_layers[:-1]:
            hidden = model.exit_hidden(k, out.hidden_states[k])[0, t]
            logits = torch.nn.functional.linear(hidden, model.backbone.head_weight)
            if rule(k, logits, hidden):
                got = k
                break
        assert got == expected[t], t


@pytest.mark.parametrize("args,msg", [
    (["epsilon=1.5"], "epsilon must be in (0, 1)"),
    (["delta=0"], "delta must be in (0, 1)"),
    (["calib_tokens=100"], "at least 332 calibration tokens"),
    (["calibrator=maxprob"], "platt or isotonic"),
])
def test_calibrate_bad_input(micro_run, capsys, args, msg):
    assert cli(["calibrate", f"run_dir={micro_run}", *args]) == 2
    assert msg in capsys.readouterr().err
    assert not (micro_run / "calibration").exists()


def test_calibrate_empty_eval_data(micro_run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["calibrate", f"run_dir={micro_run}", "--eval-data", str(empty)]) == 2
    assert "holds no text files" in capsys.readouterr().err
    assert not (micro_run / "calibration").exists()


def test_calibrate_refuses_modified_checkpoint(micro_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["distill"]["outputs"]["checkpoint"]["path"] = str(run / "multi_exit")
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "multi_exit" / "exits.json").write_text("{}")
    assert cli(["calibrate", f"run_dir={run}"]) == 2
    assert "changed since stage 'distill'" in capsys.readouterr().err


def test_finetuned_backbone_is_measured_against_its_base_model(micro_run, tmp_path):
    """freeze_backbone=false changes the decoder: distillation records the base model's held-out
    numbers next to the new ones, and calibration reports accuracy loss against the base too."""
    base = micro_run.parent / "model"
    run = tmp_path / "ft"
    assert cli(["distill", f"model={base}", f"run_dir={run}", "steps=2", "seq_len=32", "batch_size=2",
                "train_tokens=4000", "eval_windows=2", "exits.layers=[1,2,3]", "exits.adapter_rank=4",
                "freeze_backbone=false", "lr=0.01"]) == 0
    meta = json.loads((run / "multi_exit" / "exits.json").read_text())
    assert meta["source"]["backbone_finetuned"] is True and meta["source"]["base_model"] == str(base)
    assert meta["metrics"]["base_heldout_ppl"] != meta["metrics"]["heldout_ppl"]
    assert cli(["calibrate", f"run_dir={run}", "seq_len=32", "calib_tokens=2000", "test_tokens=1000",
                "free_run_prompts=2", "prompt_tokens=16", "free_run_tokens=4", "threads=1", "epsilon=0.2"]) == 0
    cal = json.loads((run / "manifest.json").read_text())["stages"]["calibrate"]["metrics"]
    assert 0.0 <= cal["accuracy_base_model"] <= 1.0
    assert cal["accuracy_loss_rel_vs_base_model"] == pytest.approx(1 - cal["accuracy_exit"] / cal["accuracy_base_model"])


def test_lineage_of_a_finetuned_model_carries_to_frozen_distillation(micro_run, tmp_path):
    """A model folder made by `make-ee` (decoder fine-tuned, lineage.json) distilled with the decoder
    frozen still reports against the model it came from."""
    from edge.bundled import make_bundled_ee, read_lineage

    base = micro_run.parent / "model"
    ft = tmp_path / "ft"
    assert cli(["distill", f"model={base}", f"run_dir={ft}", "steps=2", "seq_len=32", "batch_size=2",
                "train_tokens=4000", "eval_windows=2", "exits.layers=[1,2,3]", "exits.adapter_rank=4",
                "freeze_backbone=false", "lr=0.01"]) == 0
    ee = make_bundled_ee(ft, tmp_path / "model-ee")
    assert read_lineage(ee)["base_model"] == str(base) and not (ee / "exits.json").exists()
    run = tmp_path / "heads"
    assert cli(["distill", f"model={ee}", f"run_dir={run}", "steps=2", "seq_len=32", "batch_size=2",
                "train_tokens=4000", "eval_windows=2", "exits.layers=[1,2,3]", "exits.adapter_rank=4"]) == 0
    source = json.loads((run / "multi_exit" / "exits.json").read_text())["source"]
    assert source["backbone_finetuned"] is True and source["base_model"] == str(base)
    with pytest.raises(CheckpointError, match="kept its decoder frozen"):
        make_bundled_ee(run, tmp_path / "nope")
