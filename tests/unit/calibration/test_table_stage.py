"""Threshold table (hash binding, raw-score rule) and the calibrate stage's error handling."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from calibration.calibrators import Calibrator, CalibratorKind, fit_calibrators
from calibration.collect import collect_units
from calibration.cascade import cascade
from calibration.signals import exit_targets
from calibration.table import TableRule, ThresholdTable, load_table
from edge.core.artifacts import sha256_path
from edge.pipeline.cli import main as cli
from edge.core.errors import ArtifactError, CheckpointError, ConfigError
from edge.model.exits import exit_decision_stats, load_multi_exit
from edge.model.windows import stream_windows


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
    form = cal.score_form()  # the runtime form: what the graphs compute (float32)
    assert np.allclose(form(Xt.astype(np.float32)), s, rtol=1e-5, atol=1e-5)
    if kind is not CalibratorKind.MLP:  # a linear score: one dot product
        w, b = cal.linear_score()
        assert np.allclose(Xt @ w + b, s, rtol=1e-12, atol=1e-9)


def _table_for(run, lam=0.6):
    ckpt = run / "multi_exit"
    model = load_multi_exit(ckpt)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, model.backbone.cfg.vocab_size, 2000).astype(np.uint16)
    data = collect_units(model, stream_windows(tokens, 32, 32), first=0)
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
    for t in range(32):  # one row at a time, as the reference generator asks
        got = data.final
        for k in model.exit_layers[:-1]:
            upto = [j for j in model.exit_layers[:-1] if j <= k]
            row = lambda d: {j: d[j][t:t + 1] for j in upto}  # noqa: E731
            if rule.decide(k, row(stats), row(toks), row(hid))[0]:
                got = k
                break
        assert got == expected[t], t


def test_table_version_and_kv_mode(micro_run, tmp_path):
    _, _, _, table, _ = _table_for(micro_run)
    path = tmp_path / "thresholds.json"
    table.save(path)
    d = json.loads(path.read_text())
    assert d["version"] == 2 and d["kv_mode"] == "defer"
    assert load_table(path, micro_run / "multi_exit").kv_mode == "defer"
    d["kv_mode"] = "propagate"
    path.write_text(json.dumps(d))
    assert load_table(path, micro_run / "multi_exit").kv_mode == "propagate"
    d["kv_mode"] = "sometimes"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="kv_mode must be 'defer' or 'propagate'"):
        load_table(path, micro_run / "multi_exit")
    d["version"], d["kv_mode"] = 1, "defer"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="version 1 is not 2; version 1 tables were certified on the tokens"):
        load_table(path, micro_run / "multi_exit")
    del d["kv_mode"]
    d["version"] = 2
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="malformed threshold table.*kv_mode"):
        load_table(path, micro_run / "multi_exit")


# a micro calibration: eps 0.2 needs only 15 certify prompts
MICRO = ["epsilon=0.2", "fit_units=16", "certify_units=32", "propagate_units=32", "eval_units=8", "prompt_tokens=16",
         "new_tokens=4", "batch=16", "threads=1"]


@pytest.mark.slow  # 4-9 s: the whole calibrate stage on the micro run
def test_calibrate_writes_a_certificate_for_the_shipped_regime(micro_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    assert cli(["calibrate", f"run_dir={run}", *MICRO]) == 0
    table = json.loads((run / "calibration" / "thresholds.json").read_text())
    cal = json.loads((run / "manifest.json").read_text())["stages"]["calibrate"]["metrics"]
    assert table["kv_mode"] == cal["kv_mode"] in ("defer", "propagate")
    assert table["statement"] == cal["certificate_statement"] and "over the draw of the" in table["statement"] \
        or not cal["certified"]
    assert table["unit"] == "prompt" and table["n_units"] == cal["n_units"] >= cal["min_units"] == 15
    # the certificate's arithmetic: the bound covers the empirical rate; certified iff the bound is within eps
    assert cal["bound"] >= cal["false_exit_rate_calib"]
    assert cal["certified"] == (cal["p_value"] <= cal["delta"])
    if cal["certified"]:
        assert cal["bound"] <= cal["epsilon"]
    else:  # nothing certified: the rule never exits
        assert cal["layers_skipped_frac"] == 0.0 and cal["false_exit_rate_calib"] == 0.0
    assert cal["tokens_per_unit"] == 3 and cal["n_calibration_tokens"] == 3 * cal["n_units"]
    assert cal["engine_agreement"] == 1.0 or cal["kv_mode_choice"] == "propagate"
    for key in ("layers_skipped_frac", "false_exit_rate_test", "free_run_false_exit_rate_test", "accuracy_loss_rel",
                "free_run", "free_run_by_kv_mode", "comparison", "propagate_test", "certificate_exact",
                "lambda_provisional", "calibration_corpus", "eval_data"):
        assert key in cal, key
    assert cal["layers_skipped_frac"] == cal["free_run"]["layers_skipped_frac"]


@pytest.mark.slow  # ~4 s: the calibrate stage on the micro run
def test_propagate_after_a_walk_that_stopped_early_is_tested_directly(micro_run, tmp_path, monkeypatch):
    """kv_mode=propagate with a provisional threshold that lets every token leave (0.0: the walk stops long before
    it): the walk's certificate is about another rule's continuations, so the certified threshold is tested
    directly in propagate mode on the propagate-test prompts, and what ships is what that test says."""
    from calibration import certify

    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    monkeypatch.setattr(certify, "provisional_lambda", lambda *a, **k: 0.0)
    assert cli(["calibrate", f"run_dir={run}", *MICRO, "kv_mode=propagate", "epsilon=0.25"]) == 0
    cal = json.loads((run / "manifest.json").read_text())["stages"]["calibrate"]["metrics"]
    walk, direct = cal["certify_walk"], cal["propagate_test"]
    assert walk["certified"] and not walk["exact"] and walk["lambda_provisional"] == 0.0
    assert direct is not None and direct["n_units"] >= 15  # the fresh prompts' own test
    assert cal["certified"] == direct["certified"] and cal["bound"] == direct["bound"] and cal["certificate_exact"]
    assert cal["kv_mode"] == "propagate" and "tested directly" in cal["kv_mode_reason"]
    if cal["certified"]:
        assert cal["lambda"] == walk["lambda"] and cal["bound"] <= 0.25
    else:  # the table never exits
        assert cal["lambda"] == 2.0 and cal["layers_skipped_frac"] == 0.0


@pytest.mark.parametrize("args,msg", [
    (["epsilon=1.5"], "epsilon must be in (0, 1)"),
    (["delta=0"], "delta must be in (0, 1)"),
    (["certify_units=100"], "at least 369 certify units"),
    (["certify_units=400", "propagate_units=10"], "at least 369 units are needed"),
    (["calibrator=maxprob"], "platt, isotonic or mlp"),
    (["pvalue=binomial"], "0/1 losses only"),
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


def test_calibrate_names_the_minimum_data(micro_run, tmp_path, capsys):
    """--calib-data with too little text: the error names the minimum prompts, documents and tokens."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for i in range(8):
        (folder / f"f{i}.py").write_text("def f(x):\n    return x + 1\n" * (20 + i))
    assert cli(["calibrate", f"run_dir={micro_run}", *MICRO, "--calib-data", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "too little calibration data" in err and "at least 15 certify prompts" in err
    assert "from at least 20 documents of >= 20 tokens" in err and "tokens)" in err
    assert not (micro_run / "calibration").exists()


@pytest.mark.slow
def test_calibrate_on_a_users_folder_evaluates_on_its_held_out_part(micro_run, tmp_path):
    from edge.core.data import Split, load_split

    folder = tmp_path / "mine"
    for d in load_split(Split.TEST):
        (folder / d.path).parent.mkdir(parents=True, exist_ok=True)
        (folder / d.path).write_text(d.text)
    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    assert cli(["calibrate", f"run_dir={run}", "kv_mode=defer", "min_documents=10", *MICRO,
                "--calib-data", str(folder)]) == 0
    cal = json.loads((run / "manifest.json").read_text())["stages"]["calibrate"]["metrics"]
    assert "held-out documents of" in cal["eval_data"] and str(folder) in cal["calibration_corpus"]
    assert cal["kv_mode"] == "defer" and cal["propagate_test"] is None


def test_calibrate_refuses_modified_checkpoint(micro_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["distill"]["outputs"]["checkpoint"]["path"] = str(run / "multi_exit")
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "multi_exit" / "exits.json").write_text("{}")
    assert cli(["calibrate", f"run_dir={run}"]) == 2
    assert "changed since stage 'distill'" in capsys.readouterr().err


@pytest.mark.slow  # 5-10 s: distils and calibrates a fine-tuned copy
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
    assert cli(["calibrate", f"run_dir={run}", *MICRO]) == 0
    cal = json.loads((run / "manifest.json").read_text())["stages"]["calibrate"]["metrics"]
    assert 0.0 <= cal["accuracy_base_model"] <= 1.0
    base = cal["accuracy_base_model"]  # the random micro model may well be right on none of the few tokens
    assert cal["accuracy_loss_rel_vs_base_model"] == (pytest.approx(1 - cal["accuracy_exit"] / base) if base else 0.0)


@pytest.mark.slow  # 4-11 s: distils and calibrates a make-ee folder
def test_lineage_of_a_finetuned_model_carries_to_frozen_distillation(micro_run, tmp_path):
    """A model folder made by `make-ee` (decoder fine-tuned, lineage.json) distilled with the decoder
    frozen still reports against the model it came from."""
    from edge.model.bundled import read_lineage
    from edge.training.bundle_ee import make_bundled_ee

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


@pytest.mark.slow
def test_calibrate_a_model_with_exit_gates(micro_run, tmp_path):
    """With exit gates the engine decides from the gates alone (decide_gated): calibration fits on the
    gates' outputs and the table's rule decides there, and refuses the other interface."""
    from calibration.signals import GATED_SIGNAL_NAMES

    base = micro_run.parent / "model"
    run = tmp_path / "gated"
    assert cli(["distill", f"model={base}", f"run_dir={run}", "steps=2", "seq_len=32", "batch_size=2",
                "train_tokens=4000", "eval_windows=2", "exits.layers=[1,2,3]", "exits.adapter_rank=4",
                "exits.gate_hidden=8", "gate_windows=8"]) == 0
    assert cli(["calibrate", f"run_dir={run}", *MICRO]) == 0
    table = load_table(run / "calibration" / "thresholds.json", run / "multi_exit")
    assert tuple(table.signal_names) == GATED_SIGNAL_NAMES
    rule = TableRule(table)
    hidden = {1: np.ones((2, 64)), 2: np.ones((2, 64))}
    assert rule.decide_gated(2, {1: np.array([-9.0, 9.0]), 2: np.array([-9.0, 9.0])}, hidden).shape == (2,)
    with pytest.raises(ConfigError, match="calibrated on exit gates, but the model it runs has none"):
        rule.decide(1, {1: np.zeros((2, 3))}, {1: np.zeros(2, int)}, {1: np.ones((2, 64))})
    cal = json.loads((run / "manifest.json").read_text())["stages"]["calibrate"]["metrics"]
    assert cal["comparison"][0]["system"].startswith("(a) gate prob")


def test_table_rule_decides_as_the_calibrated_score_of_the_signals():
    """TableRule.decide / decide_gated compute the calibrator's linear score with the threshold folded
    into its bias; they must decide exactly as the calibrated score over the signal functions does."""
    from calibration.calibrators import Calibrator, CalibratorKind
    from calibration.signals import GATED_SIGNAL_NAMES, SIGNAL_NAMES, gated_signals, signals_from_stats
    from calibration.table import TableRule, ThresholdTable

    rng = np.random.default_rng(3)
    layers = [2, 5, 8, 12]
    cases = [(n, g, kind) for n, g in ((SIGNAL_NAMES, False), (GATED_SIGNAL_NAMES, True))
             for kind in (CalibratorKind.PLATT, CalibratorKind.ISOTONIC)]
    for names, gated, kind in cases:
        f = len(names)
        cals = {k: Calibrator(kind).fit(rng.random((400, f)), (rng.random(400) < 0.6).astype(int))
                for k in layers[:-1]}
        thr = {k: float(np.median(cals[k].score(rng.random((50, f))))) for k in layers[:-1]}
        rule = TableRule(ThresholdTable("x", layers, kind.value, 0.5, thr, cals, signal_names=names))
        b = 64
        stats = {k: rng.random((b, 3)).astype(np.float32) for k in layers[:-1]}
        tokens = {k: rng.integers(0, 3, b) for k in layers[:-1]}
        hidden = {k: rng.standard_normal((b, 16)).astype(np.float32) for k in layers[:-1]}
        gates = {k: rng.standard_normal(b).astype(np.float32) for k in layers[:-1]}
        for n, k in enumerate(layers[:-1]):
            upto = layers[:n + 1]
            if gated:
                got = rule.decide_gated(k, {j: gates[j] for j in upto}, {j: hidden[j] for j in upto})
                ref = cals[k].score(gated_signals({j: gates[j] for j in upto}, hidden)) >= thr[k]
            else:
                got = rule.decide(k, {j: stats[j] for j in upto}, {j: tokens[j] for j in upto},
                                  {j: hidden[j] for j in upto})
                ref = cals[k].score(signals_from_stats({k: stats[k]}, {j: tokens[j] for j in upto},
                                                       {j: hidden[j] for j in upto}, num_exits=len(layers))) >= thr[k]
            assert np.array_equal(got, ref), (names, k)


def test_table_rule_agreement_is_the_calibrated_probability():
    """TableRule.agreement (what the calibrated draft-length rule of mode exact reads per draft step)
    computes the calibrator's probability from the features without predict's checks: it must equal
    Calibrator.predict for every calibrator kind, constant calibrators included."""
    from calibration.calibrators import Calibrator, CalibratorKind
    from calibration.signals import SIGNAL_NAMES
    from calibration.table import TableRule, ThresholdTable

    rng = np.random.default_rng(5)
    layers = [3, 9, 12]
    x = rng.random((300, len(SIGNAL_NAMES)))
    for kind in CalibratorKind:
        cals = {3: Calibrator(kind).fit(x, (x[:, 0] + 0.3 * rng.random(300) > 0.6).astype(int)),
                9: Calibrator(kind).fit(x, np.ones(300, int))}  # all targets 1: a constant calibrator
        rule = TableRule(ThresholdTable("x", layers, kind.value, 0.5, {3: 0.0, 9: 0.0}, cals))
        feats = rng.random((64, len(SIGNAL_NAMES))).astype(np.float32)
        for k in (3, 9):
            # float64 both ways, the score reassociated ((x - mean) / std @ coef vs x @ (coef / std) + b): the
            # probabilities (scale 1, continuous in the score) agree to a few float64 ulps of that scale
            # (an mlp's first layer has the standardisation folded in: float32 weights, so float32's rounding)
            tol = 1e-5 if kind is CalibratorKind.MLP else 1e-9
            np.testing.assert_allclose(rule.agreement(k, feats), cals[k].predict(feats), rtol=tol, atol=tol * 1e-3)
        assert cals[9].constant is not None and np.all(rule.agreement(9, feats) == cals[9].constant)
