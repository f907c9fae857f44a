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

import numpy as np
import torch

from edge.core.data import Split, load_split
from edge.core.errors import ConfigError
from edge.model.exits import MultiExitModel
from edge.model.tokenizer import encode_documents
from edge.training.config import DistillConfig
from edge.training.layerskip import lr_at
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
