"""Shared fixtures: tiny deterministic HF checkpoints built in the test (never a download)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=320, max_position_embeddings=256)


def make_hf_checkpoint(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised transformers model of ``family`` to ``folder``."""
    import transformers

    torch.manual_seed(seed)
    kw = {**SMALL, **overrides}
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    model = model_cls(cfg_cls(**kw)).eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return make_hf_checkpoint(tmp_path / "llama", "llama")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    on_jetson = Path("/etc/nv_tegra_release").exists()
    for item in items:
        # the marker, not the keywords: a test's keywords hold its folder's name (tests/unit/jetson runs anywhere)
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)"))
        if item.get_closest_marker("jetson") is not None and not on_jetson:
            item.add_marker(pytest.mark.skip(reason="needs a Jetson (no /etc/nv_tegra_release)"))


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory) -> Path:
    """A run folder with a distilled micro model (random weights, own small tokenizer)."""
    from edge.pipeline.cli import main as cli
    from edge.core.data import Split, load_split
    from edge.model.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("micro")
    tok = train_tokenizer([d.text for d in load_split(Split.CALIBRATION)[:20]], vocab_size=400)
    model_dir = make_hf_checkpoint(root / "model", "llama", vocab_size=tok.get_vocab_size(), initializer_range=0.2)
    tok.save(str(model_dir / "tokenizer.json"))
    run = root / "run"
    rc = cli(["distill", f"model={model_dir}", f"run_dir={run}", "steps=3", "seq_len=32", "batch_size=2",
              "train_tokens=4000", "eval_windows=2", "exits.layers=[1,2,3]", "exits.adapter_rank=4"])
    assert rc == 0
    return run
