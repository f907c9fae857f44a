"""The bundled tiny model shipped inside the package (``edge/assets/tiny``)."""
from __future__ import annotations

from pathlib import Path

from edge.errors import CheckpointError

BUNDLED_DIR = Path(__file__).parent / "assets" / "tiny"
BUNDLED = "bundled"


def resolve_model(name: str | Path) -> Path:
    """``"bundled"`` -> the shipped tiny model; anything else is a local folder that must exist."""
    if str(name) == BUNDLED:
        if not (BUNDLED_DIR / "model.safetensors").is_file():
            raise CheckpointError(f"the bundled model is missing from {BUNDLED_DIR}; run `make train-tiny`")
        return BUNDLED_DIR
    path = Path(name)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist or is not a folder")
    return path
