"""The bundled tiny model end to end: its published numbers reproduce, and every stage runs on it."""
from __future__ import annotations

import json

import pytest
import torch

from edge.model.bundled import BUNDLED_DIR, resolve_model
from edge.model.checkpoint import load_decoder
from edge.pipeline.cli import main as cli
from edge.core.data import Split, load_split
from edge.model.tokenizer import encode_documents, load_tokenizer
from edge.training.train_tiny import evaluate
from tests.images import assert_calibration_plots

pytestmark = pytest.mark.integration


def test_bundled_model_shape_and_size():
    model = load_decoder(resolve_model("bundled"))
    assert model.cfg.num_layers >= 12 and model.cfg.arch.value == "LlamaForCausalLM"
    size = sum(f.stat().st_size for f in BUNDLED_DIR.iterdir() if f.suffix in (".safetensors", ".json"))
    assert size <= 25 * 2**20
    tok = load_tokenizer(BUNDLED_DIR)
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.slow
def test_published_heldout_numbers_reproduce():
    """The model card's perplexity / accuracy are what evaluation of the shipped weights gives."""
    torch.set_num_threads(2)
    info = json.loads((BUNDLED_DIR / "training.json").read_text())["summary"]
    model = load_decoder(BUNDLED_DIR)
    tok = load_tokenizer(BUNDLED_DIR)
    ids = encode_documents(tok, [d.text for d in load_split(Split.TEST)])
    got = evaluate(model, ids, info["config"]["seq_len"], max_windows=128)
    assert got["tokens"] == info["heldout_tokens"]
    assert got["ppl"] == pytest.approx(info["heldout_ppl"], rel=1e-4)
    assert got["top1"] == pytest.approx(info["heldout_top1"], abs=1e-4)
    card = (BUNDLED_DIR / "MODEL_CARD.md").read_text()
    assert f"{info['heldout_ppl']:.3f}" in card and f"{info['heldout_top1']:.4f}" in card
    assert f"{info['tokens_seen']:,}" in card


@pytest.mark.slow
def test_every_stage_on_the_bundled_model(tmp_path):
    run = tmp_path / "run"
    assert cli(["distill", "model=bundled", f"run_dir={run}", "steps=4", "batch_size=2", "seq_len=128",
                "train_tokens=20000", "eval_windows=4"]) == 0
    assert cli(["calibrate", f"run_dir={run}", "epsilon=0.05", "fit_units=32", "certify_units=96",
                "propagate_units=96", "eval_units=16", "prompt_tokens=32", "new_tokens=8", "threads=1"]) == 0
    assert cli(["generate", f"run_dir={run}", "prompts=2", "prompt_tokens=32", "max_new_tokens=8"]) == 0
    assert cli(["report", f"run_dir={run}"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["model"]["layers"] == 12 and report["model"]["exits"] == [3, 6, 9, 12]
    agree = report["distill"]["exit_agreement"]
    assert set(agree) == {"3", "6", "9", "12"}
    # a trained model: a deeper exit agrees more with the last layer, none always (an exit compared with
    # itself, or with the wrong layer, breaks this)
    assert 0 < agree["3"] < agree["9"] < 1
    cal = report["calibration"]
    for key in ("epsilon", "delta", "n_units", "n_calibration_tokens", "bound", "false_exit_rate_test",
                "free_run_false_exit_rate_test", "accuracy_full", "accuracy_exit", "accuracy_loss_rel",
                "layers_skipped_frac", "exit_fraction"):
        assert key in cal, key
    # the certificate is what its numbers say: certified iff the p-value passes delta; an upper
    # confidence bound above the empirical rate; certified -> a real threshold with bound <= epsilon;
    # not certified -> the shipped rule never exits (the held-out free run skips nothing)
    assert cal["certified"] == (cal["p_value"] <= cal["delta"])
    assert cal["false_exit_rate_calib"] <= cal["bound"]
    if cal["certified"]:
        assert cal["bound"] <= cal["epsilon"] and cal["lambda"] <= 1.0
    else:
        assert cal["lambda"] > 1.0 and cal["layers_skipped_frac"] == 0.0
    assert report["generate"]["disabled_equals_full_greedy"] is True
    assert (run / "calibration" / "thresholds.json").is_file() and (run / "report.md").is_file()
    assert_calibration_plots(run)
