"""Load and save Hugging Face model folders (``config.json`` + safetensors).

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
Every failure is a :class:`CheckpointError` naming the file and what was wrong;
loading never writes anything.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from edge.core.artifacts import atomic_write_text, atomic_path
from edge.model.config import ModelConfig
from edge.core.errors import CheckpointError
from edge.model.decoder import Decoder

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(folder: str | Path) -> ModelConfig:
    """Parse ``folder/config.json`` into a :class:`ModelConfig`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist or is not a folder")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a model folder needs config.json and safetensors weights")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return ModelConfig.from_hf(raw, source=str(path))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is malformed (expected a 'weight_map' object): {exc}") from exc
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / SINGLE).is_file():
        files = [folder / SINGLE]
    else:
        raise CheckpointError(f"{folder} has no {SINGLE} or {INDEX}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight shard {f} listed in {INDEX} is missing")
    return files


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, keyed by HF name."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(folder)):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    out[key] = sf.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{f} is corrupt or truncated: {exc}") from exc
    return out


def load_decoder(folder: str | Path, dtype: torch.dtype = torch.float32,
                 prepare: Callable[[Decoder], None] | None = None) -> Decoder:
    """Build a :class:`Decoder` from a local HF folder. ``prepare`` reshapes the freshly built decoder
    before its weights load (a compressed checkpoint: pruned shapes, quantized linears and their scales).

    Raises:
        CheckpointError: missing folder / files, unsupported architecture, corrupt
            safetensors, missing tensors, or tensor shapes that disagree with config.json.
    """
    folder = Path(folder)
    cfg = read_config(folder)
    tensors = read_tensors(folder)
    model = Decoder(cfg)
    if prepare is not None:
        prepare(model)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        name = key.removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints also store the (identical) head
        if name not in expected:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise CheckpointError(f"{folder}: unexpected tensor {key!r} for {cfg.arch.value}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{folder}: tensor {key!r} has shape {tuple(t.shape)} but config.json implies "
                f"{tuple(expected[name].shape)}"
            )
        state[name] = t.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{folder}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(state)
    return model.to(dtype).eval()


def save_decoder(model: Decoder, folder: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in HF layout (atomically, file by file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head") else f"model.{name}"
        tensors[key] = t.detach().to(dtype).contiguous()
    with atomic_path(folder / SINGLE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(folder / "config.json", json.dumps(model.cfg.to_hf(), indent=2) + "\n")
    return folder
