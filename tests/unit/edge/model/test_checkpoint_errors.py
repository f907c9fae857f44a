"""Bad model folders: a clear message, exit code 2, and nothing written."""
from __future__ import annotations

import json

import pytest

from edge.model.checkpoint import load_decoder
from edge.pipeline.cli import main as cli
from edge.core.errors import CheckpointError
from tests.conftest import make_hf_checkpoint


def _distill(tmp_path, model, capsys):
    run_dir = tmp_path / "run"
    rc = cli(["distill", f"model={model}", f"run_dir={run_dir}", "steps=1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert not run_dir.exists(), "a failed stage must not write anything"
    return err


def test_missing_folder(tmp_path, capsys):
    err = _distill(tmp_path, tmp_path / "nope", capsys)
    assert "does not exist" in err and "nope" in err


def test_unsupported_architecture_names_supported(tmp_path, llama_dir, capsys):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    err = _distill(tmp_path, llama_dir, capsys)
    assert "GPT2LMHeadModel" in err
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert name in err


def test_truncated_safetensors(tmp_path, llama_dir, capsys):
    f = llama_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = _distill(tmp_path, llama_dir, capsys)
    assert "corrupt or truncated" in err and "model.safetensors" in err


def test_garbage_safetensors(tmp_path, llama_dir, capsys):
    (llama_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "corrupt or truncated" in _distill(tmp_path, llama_dir, capsys)


def test_shapes_disagree_with_config(tmp_path, llama_dir, capsys):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] = 128  # weights were saved with 96
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    err = _distill(tmp_path, llama_dir, capsys)
    assert "mlp" in err and "(64, 96)" in err and "config.json implies (64, 128)" in err


def test_invalid_json_config(tmp_path, llama_dir, capsys):
    (llama_dir / "config.json").write_text("{not json")
    assert "not valid JSON" in _distill(tmp_path, llama_dir, capsys)


def test_missing_weights(tmp_path, llama_dir, capsys):
    (llama_dir / "model.safetensors").unlink()
    assert "no model.safetensors" in _distill(tmp_path, llama_dir, capsys)


def test_sharded_checkpoint_loads(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "sharded", "llama", max_position_embeddings=128)
    import transformers
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    out = tmp_path / "sharded2"
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    ours = load_decoder(out)
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, model(ids).logits, atol=1e-4)


def test_missing_shard(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "s", "llama")
    import transformers

    out = tmp_path / "s2"
    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, max_shard_size="100KB")
    shard = sorted(out.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_decoder(out)
