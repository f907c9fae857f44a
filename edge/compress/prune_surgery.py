"""The structural surgery of pruning: removing MLP neurons and query heads physically from a layer
(its ``nn.Linear`` matrices get smaller), and the shapes of a pruned model: read off it to store with
the weights, and applied to a freshly built model so that a pruned ``state_dict`` loads into it.

Only query heads are removed, the same number in every KV group, so K/V (and the KV cache) keep
their shape and GQA stays uniform (the runtime's GroupQueryAttention op still applies).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edge.core.errors import CheckpointError, ConfigError
from edge.model.decoder import MLP, Attention, Decoder
from edge.model.exits import MultiExitModel


# ---- physical removal ---------------------------------------------------------------------------
def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of w [out, in] and b [out]."""
    lin = nn.utils.skip_init(nn.Linear, w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def _check_index(idx: list[int], n: int, what: str) -> torch.Tensor:
    if not idx or len(set(idx)) != len(idx) or min(idx) < 0 or max(idx) >= n:
        raise ConfigError(f"{what}: keep indices must be distinct, non-empty and in [0, {n}), got {idx}")
    return torch.tensor(sorted(idx), dtype=torch.long)


def prune_mlp(mlp: MLP, keep_idx: list[int]) -> None:
    """Keep only neurons ``keep_idx`` of a SwiGLU MLP: rows of gate/up, columns of down (in place)."""
    keep = _check_index(list(keep_idx), mlp.gate_proj.out_features, "prune_mlp").to(mlp.gate_proj.weight.device)
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    mlp.gate_proj = _linear(g.weight[keep], None if g.bias is None else g.bias[keep])
    mlp.up_proj = _linear(u.weight[keep], None if u.bias is None else u.bias[keep])
    mlp.down_proj = _linear(d.weight[:, keep], d.bias)  # the output bias is not per neuron


def prune_heads(attn: Attention, keep_heads: list[int]) -> None:
    """Keep only query heads ``keep_heads`` (the same number in every KV group; in place).

    Removes the heads' rows of q_proj and columns of o_proj and sets ``attn.num_heads``. Kept heads
    stay in order, so group g's survivors are again consecutive and still read KV head g.
    """
    h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    keep = _check_index(list(keep_heads), h, "prune_heads")
    rep = h // kvh
    per_group = torch.bincount(keep // rep, minlength=kvh)
    if not bool((per_group == per_group[0]).all()):
        raise ConfigError(f"prune_heads: every KV group must keep the same number of query heads, "
                          f"got {per_group.tolist()} per group for heads {keep.tolist()}")
    cols = (keep[:, None] * hd + torch.arange(hd)).reshape(-1).to(attn.q_proj.weight.device)  # [H' * hd]
    q, o = attn.q_proj, attn.o_proj
    attn.q_proj = _linear(q.weight[cols], None if q.bias is None else q.bias[cols])
    attn.o_proj = _linear(o.weight[:, cols], o.bias)
    attn.num_heads = keep.numel()


# ---- shapes of a pruned checkpoint --------------------------------------------------------------
def _backbone(model: Decoder | MultiExitModel) -> Decoder:
    return model.backbone if isinstance(model, MultiExitModel) else model


def layer_shapes(model: Decoder | MultiExitModel) -> dict[int, dict[str, int]]:
    """{0-based layer: {"intermediate_size": F, "num_heads": H}} for what differs from the config."""
    dec = _backbone(model)
    out: dict[int, dict[str, int]] = {}
    for i, layer in enumerate(dec.layers):
        entry = {}
        if layer.mlp.gate_proj.out_features != dec.cfg.intermediate_size:
            entry["intermediate_size"] = layer.mlp.gate_proj.out_features
        if layer.self_attn.num_heads != dec.cfg.num_heads:
            entry["num_heads"] = layer.self_attn.num_heads
        if entry:
            out[i] = entry
    return out


def apply_shapes(model: Decoder | MultiExitModel, shapes: dict[Any, dict[str, int]]) -> None:
    """Resize the layers of a freshly built model to ``shapes`` (weights left uninitialised), so that a
    pruned ``state_dict`` loads into it. Keys may be ints or strings (as read back from JSON).

    Raises:
        CheckpointError: a layer out of range, an unknown field, or a size the model cannot take.
    """
    dec = _backbone(model)
    cfg = dec.cfg
    for key, entry in shapes.items():
        i = int(key) if str(key).isdigit() else -1
        if not 0 <= i < cfg.num_layers:
            raise CheckpointError(f"pruned shapes: layer {key!r} is not one of the model's {cfg.num_layers} layers")
        if set(entry) - {"intermediate_size", "num_heads"}:
            raise CheckpointError(f"pruned shapes: layer {i} has unknown fields {sorted(set(entry))}")
        f, h = int(entry.get("intermediate_size", cfg.intermediate_size)), int(entry.get("num_heads", cfg.num_heads))
        if f < 1 or h < 1 or h % cfg.num_kv_heads:
            raise CheckpointError(f"pruned shapes: layer {i} needs intermediate_size >= 1 and num_heads a positive "
                                  f"multiple of num_kv_heads ({cfg.num_kv_heads}), got {f} and {h}")
        mlp, attn, w = dec.layers[i].mlp, dec.layers[i].self_attn, dec.layers[i].mlp.gate_proj.weight

        def empty(n_in: int, n_out: int, bias: bool) -> nn.Linear:
            return nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias, device=w.device, dtype=w.dtype)
        d, q = cfg.hidden_size, h * cfg.head_dim
        mlp.gate_proj, mlp.up_proj = empty(d, f, cfg.mlp_bias), empty(d, f, cfg.mlp_bias)
        mlp.down_proj = empty(f, d, cfg.mlp_bias)
        attn.q_proj, attn.o_proj, attn.num_heads = empty(d, q, cfg.qkv_bias), empty(q, d, cfg.o_bias), h
