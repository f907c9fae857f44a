"""LayerSkip-style early-exit training of a whole decoder (Elhoushi et al., ACL 2024).

Three ingredients, all from the paper (section 4):

* **Layer dropout** rising with depth: layer l (0-based, of L) is skipped for a
  sample with probability p_l = S(l) * p_max, S(l) = exp(l * ln 2 / (L - 1)) - 1,
  so S(0) = 0 and S(L - 1) = 1 (eq. 2 with the time scale held at 1, as the paper
  does for fine-tuning). A skipped layer passes its input through unchanged.
* **Early-exit loss** at every configured exit through the model's *own* final
  norm and LM head (no exit heads), so the decoder itself learns to be read early.
  Each exit's loss is :func:`edge.training.losses.distill_loss` against the frozen base
  model's final-layer logits (the teacher); the final layer keeps its own loss at
  weight 1 so full depth does not drift from the base.
* **Curriculum** over which early exits are on at a step: ``rotational`` (the
  exits split into R interleaved groups, one group on, the next group every C
  steps: C_rot,R), ``gradual`` (from the deepest exit downwards, one more every
  ``gradual_frac * steps / (n + 1)`` steps, all on after ``gradual_frac`` of
  training: C_grad, whose interval is T / (2L) when every layer is an exit and
  gradual_frac = 0.5), or ``none`` (all on).

Training is seeded and resumable like ``edge.training.train_tiny``: the batch, the drop
masks and the active exits of step s depend only on (seed, s), and a checkpoint
(decoder, optimiser, step, log) is written atomically every ``ckpt_every`` steps
and picked up when the run restarts.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge.core.artifacts import atomic_path, atomic_write_json
from edge.core.errors import ConfigError
from edge.training.config import Curriculum, DistillConfig, ExitWeighting, LayerSkipConfig
from edge.training.losses import distill_loss_to, teacher_targets
from edge.model.decoder import Decoder, attention_mask
from edge.model.windows import random_windows


CHECKPOINT = "checkpoint.pt"
LOG_JSON = "log.json"
LOSS_PNG = "exit_losses.png"
WARMUP = 20  # linear warm-up steps, as edge.training.distill has always used


# ---- pure schedule functions ------------------------------------------------------------------

def layer_dropout_rates(num_layers: int, p_max: float) -> np.ndarray:
    """Per-layer drop probability [L]: p_l = (exp(l ln2 / (L-1)) - 1) * p_max, 0 at the first layer,
    p_max at the last (LayerSkip eq. 2)."""
    if num_layers == 1:
        return np.array([p_max])
    scale = np.exp(np.arange(num_layers) * math.log(2) / (num_layers - 1)) - 1
    return scale * p_max


def keep_masks(rates: np.ndarray, batch: int, seed: int, step: int) -> torch.Tensor:
    """Which layer runs for which sample at ``step``: bool [L, B], drawn from (seed, step) only."""
    rng = np.random.default_rng([seed, step, 1])  # stream 1: the batch uses (seed, step)
    return torch.from_numpy(rng.random((len(rates), batch)) >= rates[:, None])


def active_exits(exits: list[int], step: int, steps: int, cfg: LayerSkipConfig) -> list[int]:
    """Exits (1-based layers, ending with the final layer) whose loss is on at ``step``."""
    early, final = exits[:-1], exits[-1]
    if cfg.curriculum is Curriculum.ROTATIONAL:
        group = (step // cfg.rotation_period) % cfg.rotation_groups
        return [k for i, k in enumerate(early) if i % cfg.rotation_groups == group] + [final]
    if cfg.curriculum is Curriculum.GRADUAL:
        interval = cfg.gradual_frac * steps / (len(early) + 1)
        on = len(early) if interval <= 0 else min(len(early), int(step // interval))
        return early[len(early) - on:] + [final]
    return [*early, final]


def exit_weights(active: list[int], num_layers: int, cfg: LayerSkipConfig) -> dict[int, float]:
    """Loss weight of each active exit; the final layer (last of ``active``) is the reference."""
    final = active[-1]
    if cfg.exit_weighting is ExitWeighting.UNIFORM:
        return {k: 1.0 if k == final else cfg.exit_loss_scale for k in active}
    # LayerSkip section 4.2: e~_l = e_scale * sum_{i=0}^{l} i for 0-based l < L-1, e~_{L-1} = L-1.
    raw = {k: float(num_layers - 1) if k == num_layers else cfg.exit_loss_scale * (k - 1) * k / 2 for k in active}
    total = sum(raw.values())
    return {k: v / total for k, v in raw.items()}


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to 0 at ``steps``."""
    return lr * min(1.0, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))


# ---- forward and loss -------------------------------------------------------------------------

def forward_with_layer_dropout(backbone: Decoder, ids: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    """Causal teacher-forced pass that runs layer i only for the samples with keep[i] true.

    ids [B, T], keep [L, B] bool -> hidden states, L + 1 entries of [B, T, D] ([0] = embeddings),
    as ``Decoder.forward`` returns them. A dropped sample's state passes the layer unchanged; kept
    samples run as a smaller batch, so dropped layers cost nothing.
    """
    b, t = ids.shape
    positions = torch.arange(t).unsqueeze(0)  # [1, T], broadcast over the batch
    cos, sin = backbone.rope(positions)
    window = backbone.cfg.sliding_window
    mask = None if window is None else attention_mask(positions, positions, window=window)
    h = backbone.embed(ids)
    hidden = [h]
    for i, layer in enumerate(backbone.layers):
        if bool(keep[i].all()):
            h = layer(h, cos, sin, None, None, mask)[0]
        elif bool(keep[i].any()):
            idx = keep[i].nonzero().squeeze(1)
            h = h.index_copy(0, idx, layer(h[idx], cos, sin, None, None, mask)[0])
        hidden.append(h)
    return hidden


def early_exit_loss(backbone: Decoder, hidden: list[torch.Tensor], teacher_logits: torch.Tensor,
                    targets: torch.Tensor, weights: dict[int, float], temperature: float, kl_weight: float,
                    head_grad_from_exits: bool = True) -> tuple[torch.Tensor, dict[int, float]]:
    """sum_k weights[k] * distill_loss(head(h_k), teacher) over the active exits.

    hidden: per-layer states [B, T, D]; teacher_logits [B*T, V]; targets [B*T]. With
    ``head_grad_from_exits`` false, the final norm and LM head (tied to the embeddings here) learn
    from the final layer's loss only: the early exits move the layers towards the head, not the head.
    Returns (loss, {exit: its unweighted loss}).
    """
    p, plogp = teacher_targets(teacher_logits, temperature)
    final = max(weights)
    total, parts = 0.0, {}
    for k, w in weights.items():
        logits = _head(backbone, hidden[k], head_grad_from_exits or k == final).reshape(teacher_logits.shape)
        lk = distill_loss_to(logits, p, plogp, targets, temperature, kl_weight)
        total = total + w * lk
        parts[k] = lk.item()
    return total, parts


def _head(backbone: Decoder, h: torch.Tensor, grad: bool) -> torch.Tensor:
    """``backbone.head(h)``, optionally with its weights detached (gradient to h only)."""
    if grad:
        return backbone.head(h)
    norm = backbone.norm
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + norm.eps)  # RMSNorm, as edge.model.decoder.RMSNorm
    return F.linear(norm.weight.detach() * hf.to(h.dtype), backbone.head_weight.detach())


# ---- the training loop ------------------------------------------------------------------------

_NOT_RECIPE = ("run_dir", "threads", "eval_windows")  # settings a resumed run may change


def _recipe(cfg: DistillConfig) -> dict:
    d = asdict(cfg)
    for k in _NOT_RECIPE:
        d.pop(k)
    return d


def train_layerskip(backbone: Decoder, teacher: Decoder, tokens: np.ndarray, cfg: DistillConfig,
                    work_dir: str | Path) -> list[dict]:
    """Train ``backbone`` in place with LayerSkip (see module docstring); resumes from ``work_dir``.

    Returns the per-step log: {"step", "loss", "exits": {layer: loss}, "lr", "kept", "time"}, with
    ``time`` the wall seconds of training so far, accumulated across resumes.

    Raises:
        ConfigError: too little training data, or a checkpoint in ``work_dir`` from another recipe.
    """
    ls = cfg.layerskip
    work = Path(work_dir)
    L = backbone.cfg.num_layers
    exits = cfg.exits.resolved(L)
    rates = layer_dropout_rates(L, ls.p_max)
    if len(tokens) < cfg.seq_len + 2:
        raise ConfigError(f"training data has {len(tokens)} tokens, fewer than seq_len + 2 = {cfg.seq_len + 2}")
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    params = list(backbone.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    step, log = 0, []
    ckpt = work / CHECKPOINT
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["recipe"] != _recipe(cfg):
            diff = sorted(k for k in state["recipe"] if state["recipe"][k] != _recipe(cfg).get(k))
            raise ConfigError(f"{ckpt} was written by another recipe (differs in {diff}); "
                              f"use another run_dir or delete {work} to start over")
        backbone.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
        print(f"layerskip: resumed at step {step}", flush=True)
    backbone.train()
    t0 = time.time() - (log[-1]["time"] if log else 0.0)
    while step < cfg.steps:
        lr = lr_at(step, cfg.steps, cfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = random_windows(tokens, cfg.seed, step, cfg.batch_size, cfg.seq_len)
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        keep = keep_masks(rates, cfg.batch_size, cfg.seed, step)
        weights = exit_weights(active_exits(exits, step, cfg.steps, ls), L, ls)
        with torch.no_grad():
            teacher_logits = teacher(x).logits.reshape(-1, backbone.cfg.vocab_size)
        hidden = forward_with_layer_dropout(backbone, x, keep)
        loss, parts = early_exit_loss(backbone, hidden, teacher_logits, y, weights, cfg.temperature, cfg.kl_weight,
                                      ls.head_grad_from_exits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        log.append({"step": step, "loss": loss.item(), "exits": {str(k): v for k, v in parts.items()},
                    "lr": lr, "kept": keep.float().mean().item(), "time": time.time() - t0})
        if step % 10 == 0 or step == cfg.steps:
            recent = log[-10:]
            print(f"layerskip step {step}/{cfg.steps} loss {np.mean([r['loss'] for r in recent]):.4f} "
                  f"final {np.mean([r['exits'][str(L)] for r in recent]):.4f} "
                  f"{(log[-1]['time'] - (log[-11]['time'] if len(log) > 10 else 0)) / len(recent):.2f}s/step",
                  flush=True)
        if step % ls.ckpt_every == 0 or step == cfg.steps:
            with atomic_path(ckpt) as tmp:
                torch.save({"model": backbone.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                            "recipe": _recipe(cfg)}, tmp)
    backbone.eval()
    atomic_write_json(work / LOG_JSON, {"layer_dropout_rates": rates.tolist(), "log": log})
    return log


# ---- what the log says ------------------------------------------------------------------------

def exit_loss_summary(log: list[dict], frac: float = 0.2) -> dict[str, dict[str, float | None]]:
    """Per exit: mean loss over the last ``frac`` of training and its relative change from the
    ``frac`` before it (a flattened curve changes by a few percent at most)."""
    n = len(log)
    span = max(1, int(n * frac))
    out = {}
    for k in sorted({k for r in log for k in r["exits"]}, key=int):
        last = [r["exits"][k] for r in log[n - span:] if k in r["exits"]]
        prev = [r["exits"][k] for r in log[max(0, n - 2 * span):n - span] if k in r["exits"]]
        if last:
            out[k] = {"last": float(np.mean(last)),
                      "rel_change": float(np.mean(last) / np.mean(prev) - 1) if prev else None}
    return out


def plot_exit_losses(log: list[dict], path: str | Path, title: str = "LayerSkip training: loss per exit") -> Path:
    """Smoothed loss of every exit against the step (only the steps where that exit was on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({int(k) for r in log for k in r["exits"]})
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for j, k in enumerate(layers):
        pts = [(r["step"], r["exits"][str(k)]) for r in log if str(k) in r["exits"]]
        if not pts:
            continue
        steps, losses = map(np.array, zip(*pts))
        win = max(1, len(losses) // 25)
        smooth = np.convolve(losses, np.ones(win) / win, mode="valid")
        ax.plot(steps[win - 1:], smooth, lw=1.2, color=cmap(j / max(1, len(layers) - 1)), label=f"{k}")
    ax.set_xlabel("step")
    ax.set_ylabel("exit loss (KL to base x T^2, + CE)")
    ax.set_title(title, fontsize=10)
    ax.legend(title="exit layer", fontsize=7, title_fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    return Path(path)
