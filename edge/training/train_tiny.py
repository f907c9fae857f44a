"""Train the bundled tiny model on the standard-library corpus (``make train-tiny``).

Seeded and resumable: a checkpoint (model, optimiser, step, loss log) is written
atomically every ``ckpt_every`` steps and picked up on restart. The batch of
step ``s`` depends only on (seed, s), so an interrupted run resumes on the same
data it would have seen.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge.core.artifacts import atomic_path, atomic_write_json
from edge.model.config import preset
from edge.core.data import Split, load_split, ship_splits, split_documents, stdlib_documents
from edge.model.decoder import Decoder
from edge.model.tokenizer import encode_documents, load_tokenizer, train_tokenizer
from edge.model.windows import exit_metrics, full_depth, random_windows, stream_windows

BUNDLED = Path(__file__).parents[1] / "assets" / "tiny"


@dataclass
class TrainConfig:
    work_dir: str = "runs/train-tiny"
    out_dir: str = str(BUNDLED)
    preset: str = "tiny"
    vocab_size: int = 4096
    seq_len: int = 512
    batch_size: int = 12
    steps: int = 800  # steps actually run
    schedule_steps: int = 1000  # horizon of the cosine schedule (lr is still ~6e-4 at step 800)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    ckpt_every: int = 25
    threads: int = 2


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to ``min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.schedule_steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def _prepare(cfg: TrainConfig, work: Path):
    """Tokenizer and token stream of the train split (cached in ``work``)."""
    tok_path = work / "tokenizer.json"
    ids_path = work / "train_ids.npy"
    if not tok_path.exists() or not ids_path.exists():
        docs = split_documents(stdlib_documents())[Split.TRAIN]
        texts = [d.text for d in docs]
        tok = train_tokenizer(texts, cfg.vocab_size)
        with atomic_path(tok_path) as tmp:
            tok.save(str(tmp))
        ids = encode_documents(tok, texts, eos_id=tok.token_to_id("<|endoftext|>"))
        with atomic_path(ids_path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, ids)
    return load_tokenizer(tok_path), np.load(ids_path)


def evaluate(model: Decoder, tokens: np.ndarray, seq_len: int, max_windows: int = 64) -> dict:
    """Perplexity and top-1 next-token accuracy over non-overlapping windows of ``tokens``."""
    got = exit_metrics(full_depth(model), stream_windows(tokens, seq_len, max_windows))
    return {"ppl": got["heldout_ppl"], "top1": got["heldout_top1"], "tokens": got["tokens"]}


def train(cfg: TrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tok, tokens = _prepare(cfg, work)
    mcfg = preset(cfg.preset)
    mcfg.vocab_size = tok.get_vocab_size()
    mcfg.max_position_embeddings = cfg.seq_len
    mcfg.eos_token_id = mcfg.bos_token_id = tok.token_to_id("<|endoftext|>")
    model = Decoder(mcfg)
    model.init_weights(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    ckpt = work / "checkpoint.pt"
    log: list[dict] = []
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
        print(f"resumed at step {step}", flush=True)
    model.train()
    t0 = time.time() - (log[-1]["time"] if log else 0.0)  # wall time accumulates across resumes
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        batch = random_windows(tokens, cfg.seed, step, cfg.batch_size, cfg.seq_len)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        log.append({"step": step, "loss": loss.item(), "lr": lr_at(step - 1, cfg), "time": time.time() - t0})
        if step % 5 == 0:
            print(f"step {step}/{cfg.steps} loss {loss.item():.4f} {(time.time() - t0) / step:.2f}s/step",
                  flush=True)
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            with atomic_path(ckpt) as tmp:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log}, tmp)
    return finish(cfg, model, tok, log)


def finish(cfg: TrainConfig, model: Decoder, tok, log: list[dict]) -> dict:
    """Export the HF folder, evaluate on the shipped test split, write the loss curve and model card."""
    from edge.model.checkpoint import load_decoder, save_decoder

    out = Path(cfg.out_dir)
    save_decoder(model, out)
    with atomic_path(out / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    split = ship_splits()
    shipped = load_decoder(out)  # evaluate exactly what ships (fp16 weights)
    test_ids = encode_documents(tok, [d.text for d in load_split(Split.TEST)])
    metrics = evaluate(shipped, test_ids, cfg.seq_len, max_windows=128)
    summary = {
        "params": shipped.cfg.num_params(),
        "tokens_seen": len(log) * cfg.batch_size * cfg.seq_len,
        "final_train_loss": sum(r["loss"] for r in log[-20:]) / min(20, len(log)),
        "heldout_ppl": metrics["ppl"],
        "heldout_top1": metrics["top1"],
        "heldout_tokens": metrics["tokens"],
        "train_seconds": log[-1]["time"] if log else 0.0,
        "config": asdict(cfg),
        "split": {k: {kk: vv for kk, vv in v.items() if kk != "paths"} for k, v in split["splits"].items()},
    }
    atomic_write_json(out / "training.json", {"summary": summary, "log": log})
    _plot_loss(log, out / "loss.png")
    from edge.training.model_card import write_model_card

    write_model_card(out, cfg.threads)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("config", "split")}, indent=2))
    return summary


def _plot_loss(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in log]
    losses = np.array([r["loss"] for r in log])
    ax.plot(steps, losses, lw=0.6, alpha=0.5, label="batch loss")
    if len(losses) >= 20:
        smooth = np.convolve(losses, np.ones(20) / 20, mode="valid")
        ax.plot(steps[19:], smooth, lw=1.5, label="20-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("SmartExit tiny model: training loss")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
