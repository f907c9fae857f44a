"""The exit loss shared by exit-head distillation and LayerSkip training.

    loss_k = w * T^2 * KL(p_teacher^T || p_k^T) + (1 - w) * CE(p_k, next token)

(Hinton et al. 2015 for the T^2 scaling; the mix of KL-to-final and CE follows
multi-exit LM training as in EE-Tuning / LayerSkip).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
                 temperature: float, kl_weight: float) -> torch.Tensor:
    """student, teacher [N, V] logits; targets [N] -> scalar loss (see module docstring)."""
    t = temperature
    kl = F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1),
                  log_target=True, reduction="batchmean") * t * t
    ce = F.cross_entropy(student, targets)
    return kl_weight * kl + (1 - kl_weight) * ce


def teacher_targets(teacher: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's side of :func:`distill_loss`, computed once for many students.

    teacher [N, V] logits -> (p [N, V], the teacher's softmax at ``temperature``;
    sum(p log p) / N, a scalar).
    """
    log_p = F.log_softmax(teacher / temperature, -1)
    p = log_p.exp()
    return p, (p * log_p).sum() / teacher.shape[0]


def distill_loss_to(student: torch.Tensor, p_teacher: torch.Tensor, plogp_teacher: torch.Tensor,
                    targets: torch.Tensor, temperature: float, kl_weight: float) -> torch.Tensor:
    """:func:`distill_loss` from :func:`teacher_targets`: the same value, with the teacher's softmax
    computed once per batch instead of once per exit, and KL = sum p log p - sum p log q (one
    product-sum instead of ``kl_div``'s exp and difference), which costs less forward and backward.
    """
    t = temperature
    kl = (plogp_teacher - (p_teacher * F.log_softmax(student / t, -1)).sum() / student.shape[0]) * t * t
    return kl_weight * kl + (1 - kl_weight) * F.cross_entropy(student, targets)
