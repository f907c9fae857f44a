"""The compress stage's data roles and config errors (a score fitted on the tokens it is tested on
certifies nothing: fitting reads the train split, the recorded quality the test split, and the
calibration split, which certifies the exit thresholds later, is never read)."""
from __future__ import annotations

import shutil

import pytest

from edge.core.data import Split
from edge.core.errors import ConfigError
from edge.pipeline.cli import main as cli
from edge.pipeline.compress import CompressConfig

FAST = ["qat_steps=2", "seq_len=32", "fit_tokens=6000", "calib_batches=1", "sensitivity_windows=2", "eval_windows=2",
        "extra_critical=1", "threads=1"]


def test_fit_reads_train_only_and_evaluation_test_only(micro_run, tmp_path, monkeypatch):
    import edge.pipeline.compress as stage
    import edge.training.distill as distill

    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    seen: list = []
    real_split, real_train = stage.load_split, distill.load_split

    def stage_split(s):
        seen.append(("evaluate", Split(s)))
        return real_split(s)

    def train_split(s):
        seen.append(("fit", Split(s)))
        return real_train(s)

    monkeypatch.setattr(stage, "load_split", stage_split)
    monkeypatch.setattr(distill, "load_split", train_split)
    assert cli(["compress", f"run_dir={run}", "recipe=int8_mixed", *FAST]) == 0
    assert ("fit", Split.TRAIN) in seen and ("evaluate", Split.TEST) in seen
    assert all(s is not Split.CALIBRATION for _, s in seen)
    assert set(seen) == {("fit", Split.TRAIN), ("evaluate", Split.TEST)}


@pytest.mark.parametrize("override", [{"recipe": "int3"}, {"observer": "median"}, {"block_size": 24},
                                      {"prune_mlp_fraction": 1.0}, {"qat_lr": 0.0}])
def test_bad_config_is_a_clear_error(override):
    with pytest.raises((ConfigError, ValueError)):
        CompressConfig(**override)
