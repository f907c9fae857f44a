"""Multi-exit distillation (``smartexit distill``).

Each exit k learns the final layer's next-token distribution with
:func:`edge.training.losses.distill_loss` (KL at temperature T plus cross-entropy). By
default the decoder is frozen and only the exit heads train, so the full model's
outputs do not move; ``freeze_backbone=false`` fine-tunes everything against a
frozen teacher copy, and ``layerskip.enabled=true`` does that the LayerSkip way
(layer dropout, an exit loss through the shared head at every configured layer,
a curriculum, checkpoints and resume: :mod:`edge.training.layerskip`).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from edge.core.artifacts import Manifest, atomic_dir
from edge.core.data import Split, load_split
from edge.core.errors import ConfigError
from edge.model.bundled import read_lineage, resolve_model
from edge.model.checkpoint import load_decoder
from edge.model.exits import ExitConfig, MultiExitModel, choose_shortlist, save_multi_exit
from edge.model.tokenizer import encode_documents, load_tokenizer
from edge.model.windows import base_model_metrics, exit_metrics, stream_windows
from edge.training.config import DistillConfig
from edge.training.layerskip import LOSS_PNG, exit_loss_summary, lr_at, plot_exit_losses, train_layerskip
from edge.training.losses import distill_loss

STAGE = "distill"


def sample_train_tokens(tok, n_tokens: int, seed: int) -> np.ndarray:
    """About ``n_tokens`` tokens of train-split documents in a seeded order."""
    docs = load_split(Split.TRAIN)
    order = np.random.default_rng(seed).permutation(len(docs))
    picked, size = [], 0
    for i in order:
        picked.append(docs[i].text)
        size += len(docs[i].text) // 3  # ~3 bytes per token for this BPE on code
        if size >= n_tokens:
            break
    return encode_documents(tok, picked, eos_id=_eos(tok))


def _eos(tok) -> int:
    eos = tok.token_to_id("<|endoftext|>")
    return 0 if eos is None else eos


def heldout_tokens(tok, docs=None) -> np.ndarray:
    """Token stream of the shipped test split (or of ``docs``)."""
    docs = load_split(Split.TEST) if docs is None else docs
    return encode_documents(tok, [d.text for d in docs], eos_id=_eos(tok))


def train_exits(model: MultiExitModel, tokens: np.ndarray, cfg: DistillConfig) -> list[float]:
    """Run the distillation loop in place; returns the per-step losses."""
    gen = torch.Generator().manual_seed(cfg.seed)
    teacher = None
    if cfg.freeze_backbone:
        model.freeze_backbone()
    else:
        teacher = copy.deepcopy(model.backbone).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: backbone frozen and exits have no parameters")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    if len(tokens) < cfg.seq_len + 2:
        raise ConfigError(f"training data has {len(tokens)} tokens, fewer than seq_len + 2 = {cfg.seq_len + 2}")
    data = torch.from_numpy(tokens.astype(np.int64))
    losses = []
    model.train()
    for step in range(cfg.steps):
        lr = lr_at(step, cfg.steps, cfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([data[s:s + cfg.seq_len + 1] for s in starts.tolist()])
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        if teacher is None:
            with torch.no_grad():
                out = model.backbone(x)
            teacher_logits = out.logits.reshape(-1, out.logits.shape[-1])
            loss = sum(distill_loss(model.exit_logits(k, out.hidden_states[k]).reshape(teacher_logits.shape),
                                    teacher_logits, y, cfg.temperature, cfg.kl_weight)
                       for k in model.exit_layers[:-1])
        else:
            with torch.no_grad():
                teacher_logits = teacher(x).logits.reshape(-1, model.backbone.cfg.vocab_size)
            all_logits = model(x)
            loss = sum(distill_loss(lg.reshape(teacher_logits.shape), teacher_logits, y,
                                    cfg.temperature, cfg.kl_weight) for lg in all_logits.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step + 1 == cfg.steps:
            print(f"distill step {step + 1}/{cfg.steps} loss {np.mean(losses[-25:]):.4f}", flush=True)
    model.eval()
    return losses


def main(cfg: DistillConfig) -> int:
    """Distill exit heads (or train the decoder LayerSkip-style) and write ``<run_dir>/multi_exit``
    plus the manifest entry."""
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model)
    backbone = load_decoder(model_dir)
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
