"""DistillConfig refuses out-of-range settings with a ConfigError naming the field (not a traceback later)."""
from __future__ import annotations

import pytest

from edge.core.configio import parse_overrides
from edge.core.errors import ConfigError
from edge.training.config import DistillConfig


@pytest.mark.parametrize("args,msg", [
    (["train_tokens=-5"], "train_tokens must be >= seq_len \\+ 2 = 258"),
    (["seq_len=64", "train_tokens=65"], "train_tokens must be >= seq_len \\+ 2 = 66"),
    (["eval_windows=0"], "eval_windows and gate_windows must be >= 1"),
    (["gate_windows=0"], "eval_windows and gate_windows must be >= 1"),
    (["threads=0"], "distill.threads must be >= 1"),
    (["lr=0"], "lr must be a finite number > 0"),
    (["lr=.nan"], "lr must be a finite number > 0"),
    (["lr=.inf"], "lr must be a finite number > 0"),
    (["temperature=.inf"], "temperature must be a finite number > 0"),
    (["temperature=.nan"], "temperature must be a finite number > 0"),
    (["seq_len=1"], "seq_len >= 2"),
    (["steps=-1"], "steps >= 0"),
    (["batch_size=0"], "batch_size >= 1"),
    (["layerskip.exit_loss_scale=.nan"], "exit_loss_scale must be a finite number >= 0"),
])
def test_distill_config_ranges(args, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_overrides(DistillConfig(), args)


def test_distill_config_smallest_valid_settings():
    cfg = parse_overrides(DistillConfig(), ["seq_len=2", "train_tokens=4", "eval_windows=1", "gate_windows=1",
                                            "steps=0", "batch_size=1", "threads=1", "lr=1e-9"])
    assert (cfg.seq_len, cfg.train_tokens, cfg.steps) == (2, 4, 0)


def test_a_window_longer_than_the_models_positions_stops_before_anything_is_made(tmp_path):
    """seq_len over the model's max_position_embeddings ran (1024 on the bundled 512-position model) and wrote a
    checkpoint; 100000 tried to allocate 40 GB. The bundled model's config is read, nothing written."""
    from edge.pipeline.distill import main

    cfg = parse_overrides(DistillConfig(), [f"run_dir={tmp_path / 'run'}", "seq_len=1024", "train_tokens=2000",
                                            "steps=1"])
    with pytest.raises(ConfigError, match="seq_len 1024 exceeds the model's 512 positions"):
        main(cfg)
    assert not (tmp_path / "run").exists()
