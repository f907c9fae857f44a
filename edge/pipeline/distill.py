"""``smartexit distill``: the stage. The work is :mod:`edge.training.distill`'s; this module reads the run, calls it and
records what it made."""
from __future__ import annotations

import numpy as np
import time
import torch
from dataclasses import asdict
from pathlib import Path

from edge.core.artifacts import Manifest, atomic_dir
from edge.core.errors import ConfigError
from edge.model.bundled import read_lineage, resolve_model
from edge.model.checkpoint import load_decoder
from edge.model.exits import ExitConfig, MultiExitModel, choose_shortlist, save_multi_exit
from edge.model.tokenizer import load_tokenizer
from edge.model.windows import base_model_metrics, exit_metrics, stream_windows
from edge.training.config import DistillConfig
from edge.training.distill import STAGE, heldout_tokens, sample_train_tokens, train_exits
from edge.training.layerskip import LOSS_PNG, exit_loss_summary, plot_exit_losses, train_layerskip


def main(cfg: DistillConfig) -> int:
    """Distill exit heads (or train the decoder LayerSkip-style) and write ``<run_dir>/multi_exit``
    plus the manifest entry."""
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model)
    backbone = load_decoder(model_dir)
    if cfg.seq_len > backbone.cfg.max_position_embeddings:  # before any window is cut or memory allocated
        raise ConfigError(f"distill.seq_len {cfg.seq_len} exceeds the model's {backbone.cfg.max_position_embeddings} "
                          "positions (max_position_embeddings in its config.json)")
    tok = load_tokenizer(model_dir)
    exits = ExitConfig(**asdict(cfg.exits))
    run_dir = Path(cfg.run_dir)
    test_rows = stream_windows(heldout_tokens(tok), cfg.seq_len, cfg.eval_windows)  # [N, seq_len + 1]
    # The decoder differs from its base model when this run fine-tunes it, or when the model given
    # was itself fine-tuned (its lineage.json says from what): measure the base on the same windows.
    lineage = read_lineage(model_dir)
    base_model = cfg.model if not cfg.freeze_backbone else lineage.get("base_model")
    base_metrics = None if base_model is None else base_model_metrics(
        base_model, test_rows, exit_layers=exits.resolved(backbone.cfg.num_layers) if cfg.layerskip.enabled else None)
    train_ids = sample_train_tokens(tok, cfg.train_tokens, cfg.seed)
    outputs: dict[str, Path] = {}
    if cfg.layerskip.enabled:
        work = run_dir / "layerskip"
        log = train_layerskip(backbone, load_decoder(model_dir), train_ids, cfg, work)
        model = MultiExitModel(backbone, exits)  # rank-0 heads: copies of the trained final norm
        outputs["exit_losses"] = plot_exit_losses(log, work / LOSS_PNG)
        extra = {"train_seconds": log[-1]["time"] if log else 0.0, "exit_loss_summary": exit_loss_summary(log),
                 "mean_layers_kept": float(np.mean([r["kept"] for r in log])) if log else 1.0}
        losses = [r["loss"] for r in log]
    else:
        model = MultiExitModel(backbone, exits)
        losses = train_exits(model, train_ids, cfg)
        extra = {}
    if exits.shortlist:  # the candidates of every decision exit: the train text's most frequent tokens
        model.shortlist.copy_(choose_shortlist(train_ids, exits.shortlist, backbone.cfg.vocab_size))
    metrics = exit_metrics(model, test_rows)
    if model.gated:  # after the heads, on other train-split windows; AUROC on the held-out windows
        from edge.training.gates import gate_data, train_gates

        gate_ids = sample_train_tokens(tok, cfg.gate_windows * cfg.seq_len, cfg.seed + 1)
        gate_rows = stream_windows(gate_ids, cfg.seq_len, cfg.gate_windows)
        metrics["gates"] = train_gates(model, gate_data(model, gate_rows), gate_data(model, test_rows), seed=cfg.seed)
    if base_metrics is not None:
        metrics.update(base_metrics)
    metrics.update(params=backbone.cfg.num_params(), layers=backbone.cfg.num_layers,
                   exits=model.exit_layers, final_loss=float(np.mean(losses[-20:])) if losses else None, **extra)
    out = run_dir / "multi_exit"
    with atomic_dir(out) as tmp:
        save_multi_exit(model, tmp, tokenizer=Path(model_dir) / "tokenizer.json", metrics=metrics,
                        source={"model": str(model_dir), "given": cfg.model, "base_model": base_model,
                                "backbone_finetuned": base_model is not None})
    manifest = Manifest(run_dir)
    manifest.record(STAGE, inputs={"model": model_dir}, config=asdict(cfg),
                    outputs={"checkpoint": out, **outputs}, metrics=metrics, seconds=time.time() - t0)
    print(f"multi-exit checkpoint: {out}")
    for k in model.exit_layers:
        base = metrics.get("base_exit_agreement", {}).get(str(k))
        print(f"  exit {k:>3}: agreement {metrics['exit_agreement'][str(k)]:.3f}"
              + ("" if base is None else f" (base {base:.3f})")
              + f"  accuracy {metrics['exit_accuracy'][str(k)]:.3f}")
    if base_metrics is not None:
        print(f"  full depth: ppl {metrics['base_heldout_ppl']:.3f} -> {metrics['heldout_ppl']:.3f}, "
              f"top-1 {metrics['base_heldout_top1']:.4f} -> {metrics['heldout_top1']:.4f}")
    return 0
