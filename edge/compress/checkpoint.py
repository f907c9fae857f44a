"""A compressed multi-exit checkpoint: the multi-exit folder (decoder weights in float32, so that the
quantized weights' grid points stay exact; exit heads; ``exits.json``) plus ``compress.json``: the
recipe, the precision of each quantized layer, and the shapes of pruned layers. Activation scales and
INT4 block scales are buffers of the quantized linears and live in ``model.safetensors`` with the
weights (so ``exits.json``'s sha256 of that file covers them).

:func:`load_served` loads whatever checkpoint a run serves: a compressed one (its modules rebuilt
before the weights load) or a plain multi-exit one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from edge.compress.apply import quantize_head, quantize_layers, quantized_layers
from edge.compress.prune_surgery import apply_shapes, layer_shapes
from edge.compress.quant import Precision, QuantSpec
from edge.core.artifacts import atomic_write_json
from edge.core.errors import CheckpointError
from edge.model.decoder import Decoder
from edge.model.exits import MultiExitModel, load_multi_exit, save_multi_exit

COMPRESS_JSON = "compress.json"


def save_compressed(model: MultiExitModel, folder: str | Path, *, tokenizer: str | Path | None,
                    recipe: dict[str, Any], metrics: dict[str, Any], source: dict[str, Any]) -> Path:
    """Write a compressed checkpoint folder (the caller wraps it in ``atomic_dir``)."""
    folder = Path(folder)
    save_multi_exit(model, folder, tokenizer=tokenizer, metrics=metrics, source=source, dtype=torch.float32)
    atomic_write_json(folder / COMPRESS_JSON, {
        "recipe": recipe,
        "layers": {str(j): {"precision": s.precision.value, "block_size": s.block_size}
                   for j, s in quantized_layers(model).items()},
        "shapes": {str(j): v for j, v in layer_shapes(model).items()},
        "head": (None if model.backbone.head_q is None else
                 {"precision": model.backbone.head_q.spec.precision.value,
                  "block_size": model.backbone.head_q.spec.block_size}),
    })
    return folder


def read_compress_json(folder: str | Path) -> dict[str, Any] | None:
    path = Path(folder) / COMPRESS_JSON
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _preparer(meta: dict[str, Any], path: Path):
    try:
        shapes = {int(j): v for j, v in meta.get("shapes", {}).items()}
        specs = {int(j): QuantSpec(Precision(v["precision"]), int(v["block_size"]))
                 for j, v in meta.get("layers", {}).items()}
        head = meta.get("head")
        head_spec = None if head is None else QuantSpec(Precision(head["precision"]), int(head["block_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed compress.json: {exc}") from exc

    def prepare(decoder: Decoder) -> None:
        bad = [j for j in [*shapes, *specs] if not 0 <= j < len(decoder.layers)]
        if bad:
            raise CheckpointError(f"{path}: compress.json names layers {bad} the model does not have")
        apply_shapes(decoder, shapes)
        quantize_layers(decoder, specs)
        if head_spec is not None:
            quantize_head(decoder, head_spec)

    return prepare


def load_served(folder: str | Path) -> MultiExitModel:
    """The multi-exit model in ``folder``, compressed or not.

    Raises:
        CheckpointError: as :func:`edge.model.exits.load_multi_exit`, or a malformed compress.json.
    """
    meta = read_compress_json(folder)
    if meta is None:
        return load_multi_exit(folder)
    return load_multi_exit(folder, prepare=_preparer(meta, Path(folder) / COMPRESS_JSON))
