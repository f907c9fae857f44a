"""The shipped models resolve by name; bundled-ee says where it comes from."""
from __future__ import annotations

import json

import pytest

from edge.bundled import BUNDLED_DIR, BUNDLED_EE_DIR, read_lineage, resolve_model
from edge.checkpoint import load_decoder
from edge.errors import CheckpointError


def test_bundled_ee_is_the_bundled_architecture_with_a_lineage():
    assert resolve_model("bundled-ee") == BUNDLED_EE_DIR
    lineage = read_lineage(BUNDLED_EE_DIR)
    assert lineage["base_model"] == "bundled" and lineage["backbone_finetuned"] is True
    assert lineage["recipe"]["config"]["freeze_backbone"] is False
    m = lineage["metrics"]
    assert m["exit_agreement"]["3"] > 0.5 and abs(m["heldout_ppl"] - m["base_heldout_ppl"]) < 0.5
    assert load_decoder(BUNDLED_EE_DIR).cfg == load_decoder(BUNDLED_DIR).cfg
    assert read_lineage(BUNDLED_DIR) == {}


def test_unknown_folder_and_bad_lineage(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "lineage.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_lineage(tmp_path)
    (tmp_path / "lineage.json").write_text(json.dumps({"base_model": "bundled"}))
    assert read_lineage(tmp_path)["base_model"] == "bundled"
