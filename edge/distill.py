"""Multi-exit distillation (``smartexit distill``).

Each exit k learns the final layer's next-token distribution:

    loss_k = w * T^2 * KL(p_final^T || p_k^T) + (1 - w) * CE(p_k, next token)

(Hinton et al. 2015 for the T^2 scaling; the mix of KL-to-final and CE follows
multi-exit LM training as in EE-Tuning / LayerSkip). By default the decoder is
frozen and only the exit heads train, so the full model's outputs do not move;
``freeze_backbone=false`` fine-tunes everything against a frozen teacher copy.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge.artifacts import Manifest, atomic_dir
from edge.bundled import read_lineage, resolve_model
from edge.checkpoint import load_decoder
from edge.data import Split, load_split
from edge.errors import ConfigError
from edge.exits import ExitConfig, MultiExitModel, save_multi_exit
from edge.tokenizer import encode_documents, load_tokenizer

STAGE = "distill"


@dataclass
class DistillConfig:
    run_dir: str = "artifacts/demo"
    model: str = "bundled"  # "bundled", "bundled-ee" or a local HF folder
    exits: ExitConfig = field(default_factory=ExitConfig)
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    temperature: float = 2.0
    kl_weight: float = 0.7
    freeze_backbone: bool = True
    seed: int = 0
    train_tokens: int = 500_000  # tokens of the train split to sample windows from
    eval_windows: int = 64  # held-out windows of seq_len tokens for the metrics
    threads: int = 2

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.seq_len < 2:
            raise ConfigError("distill: steps >= 0, batch_size >= 1 and seq_len >= 2 are required")
        if not 0.0 <= self.kl_weight <= 1.0:
            raise ConfigError(f"distill.kl_weight must be in [0, 1], got {self.kl_weight}")
        if self.temperature <= 0:
            raise ConfigError(f"distill.temperature must be > 0, got {self.temperature}")


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
                 temperature: float, kl_weight: float) -> torch.Tensor:
    """student, teacher [N, V] logits; targets [N] -> scalar loss (see module docstring)."""
    t = temperature
    kl = F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1),
                  log_target=True, reduction="batchmean") * t * t
    ce = F.cross_entropy(student, targets)
    return kl_weight * kl + (1 - kl_weight) * ce


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


@torch.no_grad()
def exit_metrics(model: MultiExitModel, tokens: np.ndarray, seq_len: int, windows: int) -> dict:
    """Per-exit agreement with the final layer and top-1 accuracy; final-layer perplexity.

    Evaluated teacher-forced on non-overlapping windows of ``tokens``.
    """
    model.eval()
    n = min(windows, (len(tokens) - 1) // seq_len)
    if n < 1:
        raise ConfigError(f"held-out data has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    agree = {k: 0 for k in model.exit_layers}
    correct = {k: 0 for k in model.exit_layers}
    nll, count = 0.0, 0
    final = model.exit_layers[-1]
    for i in range(n):
        w = torch.from_numpy(tokens[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64)).unsqueeze(0)
        logits = model(w[:, :-1])
        top_final = logits[final].argmax(-1)
        for k, lg in logits.items():
            top = lg.argmax(-1)
            agree[k] += (top == top_final).sum().item()
            correct[k] += (top == w[:, 1:]).sum().item()
        nll += F.cross_entropy(logits[final][0], w[0, 1:], reduction="sum").item()
        count += seq_len
    return {
        "tokens": count,
        "heldout_ppl": math.exp(nll / count),
        "heldout_top1": correct[final] / count,
        "exit_agreement": {str(k): agree[k] / count for k in model.exit_layers},
        "exit_accuracy": {str(k): correct[k] / count for k in model.exit_layers},
    }


def base_model_metrics(base_model: str, tokens: np.ndarray, seq_len: int, windows: int) -> dict[str, float]:
    """Held-out perplexity and top-1 of a model at full depth, as ``base_heldout_*`` (the model a
    fine-tuned decoder came from, measured on the windows :func:`exit_metrics` reads)."""
    dec = load_decoder(resolve_model(base_model))
    got = exit_metrics(MultiExitModel(dec, ExitConfig(layers=[dec.cfg.num_layers], adapter_rank=0)),
                       tokens, seq_len, windows)
    return {"base_heldout_ppl": got["heldout_ppl"], "base_heldout_top1": got["heldout_top1"]}


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
        lr = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / max(1, cfg.steps)))
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
    """Distill exit heads and write ``<run_dir>/multi_exit`` plus the manifest entry."""
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model)
    backbone = load_decoder(model_dir)
    tok = load_tokenizer(model_dir)
    exits = ExitConfig(**asdict(cfg.exits))
    model = MultiExitModel(backbone, exits)
    test_ids = heldout_tokens(tok)
    # The decoder differs from its base model when this run fine-tunes it, or when the model given
    # was itself fine-tuned (its lineage.json says from what): measure the base on the same windows.
    lineage = read_lineage(model_dir)
    base_model = cfg.model if not cfg.freeze_backbone else lineage.get("base_model")
    base_metrics = None if base_model is None else base_model_metrics(base_model, test_ids, cfg.seq_len,
                                                                      cfg.eval_windows)
    losses = train_exits(model, sample_train_tokens(tok, cfg.train_tokens, cfg.seed), cfg)
    metrics = exit_metrics(model, test_ids, cfg.seq_len, cfg.eval_windows)
    if base_metrics is not None:
        metrics.update(base_metrics)
    metrics.update(params=backbone.cfg.num_params(), layers=backbone.cfg.num_layers,
                   exits=model.exit_layers, final_loss=float(np.mean(losses[-20:])) if losses else None)
    run_dir = Path(cfg.run_dir)
    out = run_dir / "multi_exit"
    with atomic_dir(out) as tmp:
        save_multi_exit(model, tmp, tokenizer=Path(model_dir) / "tokenizer.json", metrics=metrics,
                        source={"model": str(model_dir), "given": cfg.model, "base_model": base_model,
                                "backbone_finetuned": base_model is not None})
    manifest = Manifest(run_dir)
    manifest.record(STAGE, inputs={"model": model_dir}, config=asdict(cfg),
                    outputs={"checkpoint": out}, metrics=metrics, seconds=time.time() - t0)
    print(f"multi-exit checkpoint: {out}")
    for k in model.exit_layers:
        print(f"  exit {k:>3}: agreement {metrics['exit_agreement'][str(k)]:.3f}  "
              f"accuracy {metrics['exit_accuracy'][str(k)]:.3f}")
    return 0

