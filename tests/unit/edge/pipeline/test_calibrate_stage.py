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
from edge.pipeline.calibrate import float_model


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
