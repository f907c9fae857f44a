"""Typed configs: key=value overrides, YAML presets, and every shipped YAML validates."""
from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from edge.pipeline.cli import STAGES, _load
from edge.pipeline.cli import main as cli
from edge.model.config import Arch, ModelConfig, preset
from edge.core.configio import apply, load_yaml, parse_overrides
from edge.training.config import DistillConfig
from edge.core.errors import CheckpointError, ConfigError

CONFIGS = sorted((Path(__file__).parents[4] / "configs").glob("*.yaml"))
# which stage each preset file configures
PRESET_STAGE = {"demo.yaml": "distill", "tiny_ee.yaml": "distill", "bench_decode.yaml": "bench decode",
                "bench_serve.yaml": "bench serve", "bench_scheduler.yaml": "bench scheduler",
                "bench_scheduler_full.yaml": "bench scheduler",
                "train_scheduler.yaml": "train-scheduler", "compress.yaml": "compress",
                "bench_compress.yaml": "bench compress", "compress_study.yaml": "bench compress",
                "bench_energy.yaml": "bench energy", "calibrate.yaml": "calibrate",
                "bench_projection.yaml": "bench projection"}


def test_overrides_convert_types():
    cfg = parse_overrides(DistillConfig(), ["steps=7", "lr=0.5", "exits.layers=[2, 4]", "freeze_backbone=false"])
    assert cfg.steps == 7 and cfg.lr == 0.5 and cfg.exits.layers == [2, 4] and cfg.freeze_backbone is False


@pytest.mark.parametrize("arg,msg", [
    ("stepz=3", "unknown config key 'stepz'"),
    ("steps=three", "expected an integer"),
    ("lr=abc", "expected a number"),
    ("exits.layers=[6, 3]", "strictly increasing"),
    ("kl_weight=2", "kl_weight must be in"),
    ("steps", "expected key=value"),
    ("freeze_backbone=maybe", "expected true/false"),
])
def test_bad_overrides(arg, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_overrides(DistillConfig(), [arg])


def test_cli_bad_config_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    assert cli(["distill", "--config", str(bad), f"run_dir={tmp_path / 'r'}"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_yaml_validates(path):
    assert path.read_text().startswith("#"), "presets open with a comment saying what they are for"
    cfg_cls, _ = _load(PRESET_STAGE[path.name])
    apply(cfg_cls(), load_yaml(path))


def test_every_stage_has_a_typed_config():
    """Each stage's entry is typed ``(cfg: <its config dataclass>) -> int`` (STYLE 3), and the config's
    defaults pass its own validation unchanged (parse_overrides re-runs ``__post_init__``)."""
    for stage in STAGES:
        cfg_cls, entry = _load(stage)
        assert dataclasses.is_dataclass(cfg_cls), stage
        assert list(inspect.signature(entry).parameters) == ["cfg"], stage
        assert typing.get_type_hints(entry) == {"cfg": cfg_cls, "return": int}, stage
        assert parse_overrides(cfg_cls(), []) == cfg_cls(), stage


def test_model_config_from_hf_errors():
    with pytest.raises(CheckpointError, match="missing field 'num_attention_heads'"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})
    with pytest.raises(CheckpointError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
                             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3,
                             "intermediate_size": 8})
    with pytest.raises(CheckpointError, match="unsupported rope_type"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
                             "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
                             "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_hf_roundtrip_and_presets():
    cfg = preset("tiny")
    back = ModelConfig.from_hf(cfg.to_hf())
    assert back.to_dict() == cfg.to_dict()
    assert cfg.arch is Arch.LLAMA and cfg.num_layers >= 12
    with pytest.raises(CheckpointError, match="unknown model preset"):
        preset("huge")
