"""How important each MLP neuron and query head of a layer is, measured on calibration windows, and
which units the scores keep (the lowest-scoring ones are pruned).

Importance of a unit (an MLP neuron i, or a query head h):
  magnitude: mean over tokens of the norm of what the unit adds to the residual stream,
             |silu(gate_i) * up_i| * ||down[:, i]|| for a neuron, ||a_h @ o_proj[:, h]^T|| for a head.
  taylor:    mean over tokens of |a * dL/da| (Molchanov et al. 2017), summed over the head's
             dimensions for a head (Michel et al. 2019): the first-order change of L when the unit
             is removed. L is next-token cross-entropy averaged over exits, not the KL to the
             teacher: the first step starts at student == teacher, where the KL and its gradient are 0.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from edge.model.exits import MultiExitModel


class Importance(str, enum.Enum):
    MAGNITUDE = "magnitude"
    TAYLOR = "taylor"


@dataclass
class LayerImportance:
    neurons: torch.Tensor  # [F] score of each MLP neuron (higher = keep)
    heads: torch.Tensor  # [H] score of each query head


# ---- which units the scores keep ----------------------------------------------------------------
def keep_top(scores: torch.Tensor, n_keep: int) -> list[int]:
    """Indices of the ``n_keep`` highest scores, in increasing order (ties keep the lower index)."""
    order = torch.sort(-scores.float(), stable=True).indices
    return sorted(order[:n_keep].tolist())


def keep_heads_per_group(scores: torch.Tensor, num_kv_heads: int, n_remove: int) -> list[int]:
    """Query heads kept when the ``n_remove`` lowest-scoring heads of every KV group go.
    scores [H]; heads are grouped consecutively (GQA: group g = heads g*rep .. g*rep+rep-1)."""
    rep = scores.numel() // num_kv_heads
    return [g * rep + i for g in range(num_kv_heads) for i in keep_top(scores[g * rep:(g + 1) * rep], rep - n_remove)]


# ---- importance ---------------------------------------------------------------------------------
def _exit_ce(model: MultiExitModel, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over exits (the loss the Taylor scores differentiate)."""
    logits = model(ids)  # {exit: [B, T, V]}
    tgt = ids[:, 1:].reshape(-1)
    return sum(F.cross_entropy(z[:, :-1].reshape(-1, z.shape[-1]), tgt) for z in logits.values()) / len(logits)


def _unit_scores(kind: Importance, a: torch.Tensor, g: torch.Tensor | None, w: torch.Tensor,
                 heads: int) -> torch.Tensor:
    """Per-unit scores [U] summed over tokens.

    a [B, T, U*k]: input of down_proj (U neurons, k = 1) or of o_proj (U heads, k = head_dim);
    g: dL/da (Taylor) or None; w [D, U*k]: down_proj / o_proj weight."""
    n = a.shape[0] * a.shape[1]
    a = a.detach().reshape(n, heads, -1).float()  # [N, U, k]
    if kind is Importance.TAYLOR:
        s = (a * g.detach().reshape(n, heads, -1).float()).sum(-1).abs()  # [N, U]: |first-order change|
    else:  # ||a_u @ W_u^T|| = sqrt(a_u (W_u^T W_u) a_u^T), without forming [N, U, D]
        wu = w.detach().float().reshape(w.shape[0], heads, -1)  # [D, U, k]
        gram = torch.einsum("duk,dul->ukl", wu, wu)  # [U, k, k]
        s = torch.einsum("nuk,ukl,nul->nu", a, gram, a).clamp_min(0).sqrt()  # [N, U]
    return s.sum(0)


def measure_importance(model: MultiExitModel, layers: list[int], batches: list[torch.Tensor],
                       kind: Importance | str) -> dict[int, LayerImportance]:
    """Mean importance of every MLP neuron and query head of ``layers`` (0-based) over ``batches``
    (ids [B, T] each). Magnitude runs without gradients; Taylor backpropagates :func:`_exit_ce`
    and then clears the model's parameter gradients."""
    kind = Importance(kind)
    dec = model.backbone
    sums: dict[tuple[int, str], torch.Tensor] = {}

    def add(key: tuple[int, str], s: torch.Tensor) -> None:
        sums[key] = sums[key] + s if key in sums else s

    def hook(key: tuple[int, str], lin: nn.Linear, units: Callable[[], int]):
        def pre(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            a = args[0]
            if kind is Importance.TAYLOR:
                a.register_hook(lambda g: add(key, _unit_scores(kind, a, g, lin.weight, units())))
            else:
                add(key, _unit_scores(kind, a, None, lin.weight, units()))
        return lin.register_forward_pre_hook(pre)

    handles, flags = [], {}
    for i in layers:
        layer = dec.layers[i]
        handles.append(hook((i, "mlp"), layer.mlp.down_proj, lambda m=layer.mlp: m.down_proj.in_features))
        handles.append(hook((i, "attn"), layer.self_attn.o_proj, lambda a=layer.self_attn: a.num_heads))
        if kind is Importance.TAYLOR:  # the hooked activations must require grad
            flags.update({p: p.requires_grad for p in layer.parameters()})
            layer.requires_grad_(True)
    try:
        for ids in batches:
            if kind is Importance.TAYLOR:
                with torch.enable_grad():
                    _exit_ce(model, ids).backward()
            else:
                with torch.no_grad():
                    model(ids)
    finally:
        for h in handles:
            h.remove()
        for p, flag in flags.items():
            p.requires_grad_(flag)
        if kind is Importance.TAYLOR:
            model.zero_grad(set_to_none=True)
    n = sum(ids.shape[0] * ids.shape[1] for ids in batches)  # every token passes every layer
    return {i: LayerImportance(sums[(i, "mlp")] / n, sums[(i, "attn")] / n) for i in layers}
