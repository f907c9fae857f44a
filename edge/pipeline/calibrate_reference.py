"""The reference models the ``calibrate`` stage (:mod:`edge.pipeline.calibrate`) sets the shipped rule's accuracy
against, on the same evaluation prompts: the base model a fine-tuned decoder came from, the float model a
compressed one was made from."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge.core.errors import CheckpointError
from edge.model.exits import read_exits_json
from edge.model.windows import base_model_metrics


def reference_metrics(base: float | None, flt: float | None, accuracy_exit: float, units: int) -> dict[str, Any]:
    """The shipped rule's accuracy against the reference models', on the same ``units`` evaluation prompts
    (``accuracy_exit``: the rule's there): the base model a fine-tuned decoder came from, the float model a compressed
    one was made from (None: no such model)."""
    out: dict[str, Any] = {}
    if base is not None:
        out |= {"accuracy_base_model": base,
                "accuracy_loss_rel_vs_base_model": 1.0 - accuracy_exit / base if base > 0 else 0.0}
    if flt is not None:  # a compressed model: its exits against the float model it was compressed from, full depth
        out |= {"accuracy_float_model": flt,
                "accuracy_loss_rel_vs_float_model": 1.0 - accuracy_exit / flt if flt > 0 else 0.0}
    if out:
        out |= {"reference_units": units, "accuracy_exit_reference_units": accuracy_exit}
    return out


def base_model_accuracy(ckpt: Path, windows: np.ndarray, first: int) -> float | None:
    """Full-depth accuracy, on the evaluation tokens, of the base model when the checkpoint's decoder
    was fine-tuned (``freeze_backbone=false`` here, or earlier as recorded in the model's
    ``lineage.json``); None otherwise. Accuracy loss is then reported against that model too, not
    only against the fine-tuned full depth."""
    source = read_exits_json(ckpt).get("source", {})
    if not source.get("backbone_finetuned"):
        return None
    try:
        return base_model_metrics(source["base_model"], windows, first, batch=32)["base_heldout_top1"]
    except CheckpointError as exc:  # the base model moved: calibrate anyway, say what is missing
        print(f"note: no accuracy against the base model ({exc})", flush=True)
        return None


def float_model_accuracy(manifest, ckpt: Path, windows: np.ndarray, first: int) -> float | None:
    """Full-depth accuracy, on the evaluation tokens, of the float model a compressed checkpoint was made
    from; None for a checkpoint that is not compressed."""
    where = float_model(manifest, ckpt)
    return None if where is None else base_model_metrics(str(where), windows, first, batch=32)["base_heldout_top1"]


def float_model(manifest, ckpt: Path) -> Path | None:
    """The float checkpoint the run's compressed checkpoint ``ckpt`` was made from: the run's distilled one, as
    its manifest records it (relative to the run folder, so found wherever the folder now lies, and hash-checked;
    :meth:`Manifest.served_checkpoint` has checked that ``compress`` read it). Not the path ``compress`` wrote
    into the checkpoint, which is relative to where that stage ran: a copied run failed on it after its whole
    certification. None for a checkpoint that is not compressed."""
    if "compressed_from" not in read_exits_json(ckpt).get("source", {}):
        return None
    return manifest.verified_output("distill", "checkpoint")
