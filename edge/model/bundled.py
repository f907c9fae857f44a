"""The models shipped inside the package.

``bundled`` (``edge/assets/tiny``) is the tiny Llama trained by ``make train-tiny``.
``bundled-ee`` (``edge/assets/tiny-ee``) is the same model after early-exit
training: ``smartexit distill --config configs/tiny_ee.yaml`` (LayerSkip: layer
dropout and an exit loss at every layer, against the frozen ``bundled`` model),
made by ``make train-tiny-ee``. Its ``lineage.json`` names the base model, the
recipe and what the training changed, so later stages can report quality
against the base model as well; ``MODEL_CARD.md`` is written from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edge.core.errors import CheckpointError

ASSETS = Path(__file__).parents[1] / "assets"
BUNDLED_DIR = ASSETS / "tiny"
BUNDLED_EE_DIR = ASSETS / "tiny-ee"
BUNDLED = "bundled"
BUNDLED_EE = "bundled-ee"
BUNDLED_MODELS = {BUNDLED: (BUNDLED_DIR, "make train-tiny"), BUNDLED_EE: (BUNDLED_EE_DIR, "make train-tiny-ee")}
LINEAGE_JSON = "lineage.json"
def resolve_model(name: str | Path) -> Path:
    """``"bundled"`` / ``"bundled-ee"`` -> a shipped model; anything else is a local folder that must exist."""
    if str(name) in BUNDLED_MODELS:
        folder, make = BUNDLED_MODELS[str(name)]
        if not (folder / "model.safetensors").is_file():
            raise CheckpointError(f"the bundled model {name!r} is missing from {folder}; run `{make}`")
        return folder
    path = Path(name)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist or is not a folder")
    return path


def read_lineage(model_dir: str | Path) -> dict[str, Any]:
    """``lineage.json`` of a model folder ({} when the folder has none).

    Raises:
        CheckpointError: the file exists but is not JSON.
    """
    path = Path(model_dir) / LINEAGE_JSON
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
