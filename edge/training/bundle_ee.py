"""``bundled-ee``: a LayerSkip / early-exit fine-tuning run turned into the shipped model folder.

``python -m edge.training.bundle_ee make-ee RUN_DIR`` (``make train-tiny-ee``) copies the run's
decoder into ``edge/assets/tiny-ee`` with its lineage, model card and plots, after the full-depth
quality gate.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from edge.core.errors import CheckpointError
from edge.model.bundled import BUNDLED_EE_DIR, LINEAGE_JSON

# Issue 8: the shipped early-exit model's full-depth held-out perplexity and top-1 stay within 1%
# (relative) of the base model's.
QUALITY_GATE = 0.01
_METRICS = ("base_heldout_ppl", "base_heldout_top1", "heldout_ppl", "heldout_top1", "exit_agreement", "exit_accuracy",
            "tokens", "oracle_exit_hist", "oracle_mean_exit_layer", "base_exit_agreement", "base_exit_accuracy",
            "base_oracle_exit_hist", "base_oracle_mean_exit_layer", "exit_loss_summary")


def quality_gate(metrics: dict[str, Any], max_rel_loss: float = QUALITY_GATE) -> dict[str, Any]:
    """Full-depth perplexity and top-1 of a fine-tuned model relative to its base (``base_heldout_*``):
    passed when perplexity rose by at most ``max_rel_loss`` and top-1 fell by at most that much."""
    ppl = metrics["heldout_ppl"] / metrics["base_heldout_ppl"] - 1
    base_top1 = metrics["base_heldout_top1"]
    top1 = metrics["heldout_top1"] / base_top1 - 1 if base_top1 > 0 else 0.0  # nothing to lose from 0
    return {"max_rel_loss": max_rel_loss, "ppl_rel_change": ppl, "top1_rel_change": top1,
            "passed": bool(ppl <= max_rel_loss and top1 >= -max_rel_loss)}


def make_bundled_ee(run_dir: str | Path, out_dir: str | Path = BUNDLED_EE_DIR, enforce_gate: bool = False) -> Path:
    """Turn a ``smartexit distill freeze_backbone=false`` run into the ``bundled-ee`` model folder:
    the fine-tuned decoder (HF layout, no exit heads), ``lineage.json`` (base model, recipe, metrics,
    :func:`quality_gate`), ``MODEL_CARD.md`` and the run's plots.

    Raises:
        CheckpointError: the run kept its decoder frozen, or ``enforce_gate`` and the gate failed
            (nothing is written then).
    """
    from edge.core.artifacts import Manifest, atomic_dir, atomic_write_json
    from edge.training.ee_card import DEPTH_PNG, LOSS_PNG, plot_exit_depth, write_ee_card
    from edge.model.exits import read_exits_json
    from edge.training.layerskip import layer_dropout_rates

    manifest = Manifest(run_dir)
    ckpt = manifest.verified_output("distill", "checkpoint")
    meta = read_exits_json(ckpt)
    stage = manifest.stage("distill")
    cfg = stage["config"]
    if cfg.get("freeze_backbone", True):
        raise CheckpointError(f"{ckpt} kept its decoder frozen: there is no early-exit fine-tuned decoder to bundle")
    base_model = cfg["model"]
    m = dict(meta["metrics"])
    if "base_heldout_ppl" not in m:  # a run from before distillation measured its base: measure it now
        from edge.model.tokenizer import load_tokenizer
        from edge.model.windows import base_model_metrics, stream_windows
        from edge.training.distill import heldout_tokens

        tokens = heldout_tokens(load_tokenizer(ckpt))
        m.update(base_model_metrics(base_model, stream_windows(tokens, cfg["seq_len"], cfg["eval_windows"])))
    gate = quality_gate(m)
    if enforce_gate and not gate["passed"]:
        raise CheckpointError(
            f"{ckpt} fails the quality gate: full-depth perplexity {gate['ppl_rel_change']:+.2%} and top-1 "
            f"{gate['top1_rel_change']:+.2%} relative to {base_model!r} (allowed: {QUALITY_GATE:.0%}); lower "
            f"layerskip.p_max or layerskip.exit_loss_scale and train again")
    recipe: dict[str, Any] = {"stage": "distill", "config": cfg, "seconds": stage["seconds"],
                              "steps": cfg["steps"], "train_seconds": m.get("train_seconds", stage["seconds"])}
    if cfg.get("layerskip", {}).get("enabled"):
        recipe.update(method="layerskip", mean_layers_kept=m.get("mean_layers_kept"),
                      layer_dropout_rates=layer_dropout_rates(m["layers"], cfg["layerskip"]["p_max"]).tolist())
    lineage = {"base_model": base_model, "backbone_finetuned": True, "recipe": recipe,
               "metrics": {**{k: m[k] for k in _METRICS if k in m}, "quality_gate": gate}}
    with atomic_dir(out_dir) as tmp:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            shutil.copyfile(Path(ckpt) / name, tmp / name)
        atomic_write_json(tmp / LINEAGE_JSON, lineage)
        if "exit_losses" in stage["outputs"]:
            shutil.copyfile(manifest.verified_output("distill", "exit_losses"), tmp / LOSS_PNG)
        if "base_exit_agreement" in m:
            plot_exit_depth(m, tmp / DEPTH_PNG)
        write_ee_card(tmp, lineage)
    return Path(out_dir)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "make-ee":
    print(f"bundled-ee model: {make_bundled_ee(sys.argv[2], enforce_gate=True)}")
