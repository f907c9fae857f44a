"""The calibrate stage finds the float model a run's compressed checkpoint was made from through the run's
manifest (relative to the run folder, hash-checked), not through the path ``compress`` wrote into the checkpoint,
which is relative to where that stage ran: a copied demo run failed so after its whole certification
(2026-12-06)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edge.core.artifacts import Manifest
from edge.core.errors import ArtifactError
from edge.model.exits import EXITS_JSON
from edge.pipeline.calibrate_reference import float_model


def _run(root: Path) -> Path:
    """A run folder whose distill and compress stages are recorded as the stages record them."""
    distilled, compressed = root / "multi_exit", root / "compressed"
    for folder, source in ((distilled, {}), (compressed, {"compressed_from": "artifacts/demo/multi_exit"})):
        folder.mkdir(parents=True)
        (folder / EXITS_JSON).write_text(json.dumps({"source": source}))
    m = Manifest(root)
    m.record("distill", inputs={}, config={}, outputs={"checkpoint": distilled}, metrics={}, seconds=0.0)
    m.record("compress", inputs={"checkpoint": distilled}, config={}, outputs={"checkpoint": compressed},
             metrics={}, seconds=0.0)
    return root


def test_a_copied_run_finds_its_own_float_model(tmp_path, monkeypatch):
    other = _run(tmp_path / "artifacts" / "demo")  # where the copy's compress ran: another run now
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(other, copy)
    monkeypatch.chdir(tmp_path)  # the recorded relative path resolves to the other run from here
    assert float_model(Manifest(copy), copy / "compressed") == copy / "multi_exit"
    monkeypatch.chdir(copy.parent)  # and to nothing from here
    assert float_model(Manifest(copy), copy / "compressed") == copy / "multi_exit"


def test_an_uncompressed_checkpoint_has_none_and_a_changed_float_model_is_an_error(tmp_path):
    run = _run(tmp_path / "run")
    m = Manifest(run)
    assert float_model(m, run / "multi_exit") is None
    (run / "multi_exit" / "weights.bin").write_bytes(b"changed")
    with pytest.raises(ArtifactError, match="changed since stage 'distill'"):
        float_model(m, run / "compressed")


def test_the_reference_models_are_compared_with_the_rule_on_the_same_prompts():
    """The base and float models may be read on the first ``reference_units`` evaluation prompts only (torch,
    teacher-forced: ~15 s per 1024 prompts each on 2 cores); the rule's accuracy they are set against is then its
    accuracy on those prompts, not on all of them. Here the rule is right on every token of units 0-1 and on none of
    units 2-3: on all four it scores 0.5, on the first two 1.0, and a reference model at 0.8 is beaten by 25% there,
    where an unpaired comparison would read a 37.5% loss."""
    import numpy as np

    from calibration.collect import Collected
    from calibration.evaluate import evaluate_cascade
    from edge.core.errors import ConfigError
    from edge.pipeline.calibrate_config import CalibrateConfig
    from edge.pipeline.calibrate_reference import reference_metrics

    nxt = np.arange(12) % 5
    full = np.where(np.repeat(np.arange(4), 3) < 2, nxt, nxt + 1)  # right on units 0-1, wrong on 2-3
    test = Collected([4, 12], {}, {4: full, 12: full}, nxt, np.repeat(np.arange(4), 3), 4)
    never = {4: np.zeros(12)}  # no token leaves: the rule's tokens are the full model's
    assert evaluate_cascade(test, never, 0.5).accuracy_exit == 0.5
    sub = test.select_units(np.arange(2))
    ref = reference_metrics(0.8, 0.8, evaluate_cascade(sub, {4: np.zeros(sub.n)}, 0.5).accuracy_exit, 2)
    assert ref["accuracy_loss_rel_vs_base_model"] == pytest.approx(-0.25)
    assert ref["accuracy_loss_rel_vs_float_model"] == pytest.approx(-0.25)
    assert ref["reference_units"] == 2 and ref["accuracy_exit_reference_units"] == 1.0
    assert reference_metrics(None, None, 1.0, 2) == {}  # no reference model: nothing to report
    assert set(reference_metrics(None, 0.5, 0.5, 4)) == {"accuracy_float_model", "accuracy_loss_rel_vs_float_model",
                                                          "reference_units", "accuracy_exit_reference_units"}
    with pytest.raises(ConfigError, match="reference_units must be >= 1"):
        CalibrateConfig(reference_units=0)
