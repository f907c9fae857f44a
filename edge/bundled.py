"""The models shipped inside the package.

``bundled`` (``edge/assets/tiny``) is the tiny Llama trained by ``make train-tiny``.
``bundled-ee`` (``edge/assets/tiny-ee``) is the same model after early-exit
fine-tuning: ``smartexit distill freeze_backbone=false`` against the frozen
``bundled`` model (LayerSkip-style: every exit's loss trains the decoder), made
by ``make train-tiny-ee``. Its ``lineage.json`` names the base model, the
recipe and what the fine-tuning changed, so later stages can report quality
against the base model as well.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from edge.errors import CheckpointError

ASSETS = Path(__file__).parent / "assets"
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


def make_bundled_ee(run_dir: str | Path, out_dir: str | Path = BUNDLED_EE_DIR) -> Path:
    """Turn a ``smartexit distill freeze_backbone=false`` run into the ``bundled-ee`` model folder:
    the fine-tuned decoder (HF layout, no exit heads) plus ``lineage.json``."""
    from edge.artifacts import Manifest, atomic_dir, atomic_write_json
    from edge.exits import read_exits_json

    manifest = Manifest(run_dir)
    ckpt = manifest.verified_output("distill", "checkpoint")
    meta = read_exits_json(ckpt)
    stage = manifest.stage("distill")
    if stage["config"].get("freeze_backbone", True):
        raise CheckpointError(f"{ckpt} kept its decoder frozen: there is no early-exit fine-tuned decoder to bundle")
    base_model = stage["config"]["model"]
    m = dict(meta["metrics"])
    if "base_heldout_ppl" not in m:  # a run from before distillation measured its base: measure it now
        from edge.distill import base_model_metrics, heldout_tokens
        from edge.tokenizer import load_tokenizer

        cfg = stage["config"]
        tokens = heldout_tokens(load_tokenizer(ckpt))
        m.update(base_model_metrics(base_model, tokens, cfg["seq_len"], cfg["eval_windows"]))
    with atomic_dir(out_dir) as tmp:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            shutil.copyfile(Path(ckpt) / name, tmp / name)
        atomic_write_json(tmp / LINEAGE_JSON, {
            "base_model": base_model,
            "backbone_finetuned": True,
            "recipe": {"stage": "distill", "config": stage["config"], "seconds": stage["seconds"]},
            "metrics": {k: m[k] for k in ("base_heldout_ppl", "base_heldout_top1", "heldout_ppl", "heldout_top1",
                                          "exit_agreement", "exit_accuracy", "tokens")},
        })
    return Path(out_dir)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "make-ee":
    print(f"bundled-ee model: {make_bundled_ee(sys.argv[2])}")
