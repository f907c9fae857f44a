"""Recovery after a pruning step: a short distillation of the pruned layers from the unpruned teacher
(KL of every exit to the teacher's same exit; only the pruned layers train). Where the layers before
the first pruned one still equal the teacher's, the student starts from the teacher's hidden state
there instead of running them again."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from edge.compress.prune_config import PruneConfig
from edge.model.decoder import attention_mask
from edge.model.exits import MultiExitModel


def _exits_from(model: MultiExitModel, h: torch.Tensor, start: int, stop: int | None = None) -> dict:
    """Run decoder layers ``start`` .. from h [B, T, D] (the hidden state after ``start`` layers; ids
    [B, T] when start = 0). Returns {exit: logits [B, T, V]} of the exits reached, and under key
    "h" the hidden state after ``stop`` layers. Mirrors Decoder.forward without a past."""
    dec = model.backbone
    out: dict[Any, torch.Tensor] = {}
    if start == 0:
        h = dec.embed(h)
    b, t = h.shape[:2]
    pos = torch.arange(t, device=h.device).unsqueeze(0).expand(b, t)  # [B, T]
    cos, sin = dec.rope(pos)
    fused = dec.training and dec.cfg.sliding_window is None
    mask = None if fused else attention_mask(pos, pos, window=dec.cfg.sliding_window)
    for i in range(start, dec.cfg.num_layers):
        if i == stop:
            out["h"] = h
        h, _, _ = dec.layers[i](h, cos, sin, None, None, mask)
        if i + 1 in model.exit_layers:
            out[i + 1] = model.exit_logits(i + 1, h)
    return out


def _same_prefix(model: MultiExitModel, teacher: MultiExitModel, first: int) -> bool:
    """Whether embeddings and layers before ``first`` are equal, so the student can start from the
    teacher's hidden state after ``first`` layers (they are frozen, so they stay equal)."""
    sd_s, sd_t = model.backbone.state_dict(), teacher.backbone.state_dict()
    names = [n for n in sd_s if n.startswith("embed") or (n.startswith("layers.") and int(n.split(".")[1]) < first)]
    return all(n in sd_t and sd_s[n].shape == sd_t[n].shape and torch.equal(sd_s[n], sd_t[n]) for n in names)


def _kl(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """T^2 KL(p_teacher^T || p_student^T), mean over rows (Hinton et al. 2015); logits [N, V]."""
    log_q, log_p = F.log_softmax(student.float() / t, -1), F.log_softmax(teacher.float() / t, -1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * t * t


def recover(model: MultiExitModel, teacher: MultiExitModel, layers: list[int],
            draw: Callable[[], torch.Tensor], cfg: PruneConfig) -> list[float]:
    """``cfg.recovery_steps`` of AdamW on the pruned ``layers``: mean over exits of the KL from the
    teacher's exit to the same exit of the student, over every token."""
    params = [p for i in layers for p in model.backbone.layers[i].parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    first = layers[0]
    shared = first > 0 and _same_prefix(model, teacher, first)
    losses = []
    for _ in range(cfg.recovery_steps):
        ids = draw()  # [B, T]
        with torch.no_grad():
            t_out = _exits_from(teacher, ids, 0, stop=first)
        s_logits = _exits_from(model, t_out["h"], first) if shared else _exits_from(model, ids, 0)
        v = t_out[model.exit_layers[-1]].shape[-1]
        loss = sum(_kl(s.reshape(-1, v), t_out[k].reshape(-1, v), cfg.temperature) for k, s in s_logits.items())
        loss = loss / len(s_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
