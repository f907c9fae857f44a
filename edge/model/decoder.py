"""A compact Llama-family decoder (Llama, Qwen2, Mistral) with explicit KV tensors.

The forward pass is written so that every piece a runtime needs is callable on
its own: ``embed``, one ``DecoderLayer`` at a time (keys / values in and out as
plain tensors), ``kv_only`` (the K/V projections of a layer, for exited tokens),
and ``head`` (final norm + LM head). Module names follow Hugging Face's without
the ``model.`` prefix, so HF safetensors load by name.

References: Llama (Touvron et al. 2023), RoPE (Su et al. 2021), GQA (Ainslie et
al. 2023), SwiGLU (Shazeer 2020); Llama-3 RoPE scaling as in Meta's
``apply_scaling`` (Llama 3.1 reference code).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edge.model.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    """RMSNorm written out (the legacy ONNX exporter has no ``aten::rms_norm`` at opset 17)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with linear or Llama-3 scaling applied."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        return (inv / rope.factor).float()
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept,
        # the band between interpolated smoothly.
        old = rope.original_max_position_embeddings
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled).float()
    return inv.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, hd] for integer positions [B, T]."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd]
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, hd] (HF's half-split convention)."""
    return x * cos + _rotate_half(x) * sin


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor:
    """Additive mask [B, 1, T, S]: query at q_pos [B, T] sees keys at k_pos [B, S] with k <= q.

    ``k_valid`` [B, S] (bool) marks cache slots that hold a real key; ``window``
    is Mistral's sliding window (keys older than ``window`` positions are hidden).
    """
    allowed = k_pos.unsqueeze(1) <= q_pos.unsqueeze(2)  # [B, T, S]
    if window is not None:
        allowed = allowed & (k_pos.unsqueeze(1) > q_pos.unsqueeze(2) - window)
    if k_valid is not None:
        allowed = allowed & k_valid.unsqueeze(1)
    zero = torch.zeros((), dtype=torch.float32, device=allowed.device)  # on the device: capturable in a CUDA graph
    return torch.where(allowed, zero, torch.finfo(torch.float32).min).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=cfg.o_bias)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated) and values [B, KV, T, hd] of normalised input x [B, T, D]."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, past_k, past_v, mask):
        """x [B, T, D]; past_k/v [B, KV, P, hd]; mask [B, 1, T, P+T] or None (causal, no past).

        Returns (out [B, T, D], k, v [B, KV, T, hd] of the new tokens)."""
        b, t, _ = x.shape
        kvh, hd = self.num_kv_heads, self.head_dim
        rep = self.num_heads // kvh  # GQA: each KV head serves `rep` consecutive query heads
        q = self.q_proj(x).view(b, t, self.num_heads, hd).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_new, v_new = self.kv(x, cos, sin)
        if mask is None:  # plain causal self-attention (training): use the fused kernel
            k, v = k_new, v_new
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k_new, v_new
        # The decode path (and the exported graphs): the past is read where it lies, never copied.
        # Query heads are grouped under their KV head instead of repeating K/V, and scores against
        # the past and the new tokens are computed apart instead of concatenating K/V: at decode
        # those copies were most of a layer's memory traffic.
        qg = q.reshape(b, kvh, rep * t, hd)  # rows: (query head within group, token)
        scores = qg @ k_new.transpose(-1, -2)  # [B, KV, rep*T, T]
        if past_k is not None:
            scores = torch.cat((qg @ past_k.transpose(-1, -2), scores), dim=-1)  # [B, KV, rep*T, P+T]
        scores = scores.view(b, kvh, rep, t, -1) * (hd ** -0.5) + mask.unsqueeze(2)  # mask [B, 1, 1, T, S]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(b, kvh, rep * t, -1)
        if past_k is not None:
            p = past_k.shape[2]
            out = probs[..., :p] @ past_v + probs[..., p:] @ v_new  # [B, KV, rep*T, hd]
        else:
            out = probs @ v_new
        out = out.view(b, self.num_heads, t, hd).transpose(1, 2).reshape(b, t, self.num_heads * hd)
        return self.o_proj(out), k_new, v_new


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, past_k, past_v, mask):
        """h [B, T, D] -> (h [B, T, D], k, v [B, KV, T, hd] for the new tokens)."""
        a, k, v = self.self_attn(self.input_layernorm(h), cos, sin, past_k, past_v, mask)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v

    def kv_only(self, h, cos, sin):
        """K/V this layer would store for hidden state h [B, T, D] (CALM's state propagation)."""
        return self.self_attn.kv(self.input_layernorm(h), cos, sin)


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None  # [B, T, V]; None from ``forward(..., head=False)``
    hidden_states: list[torch.Tensor]  # num_layers + 1 entries of [B, T, D]; [0] = embeddings
    keys: list[torch.Tensor]  # per layer [B, KV, T, hd] for the input tokens
    values: list[torch.Tensor]


class Decoder(nn.Module):
    """The full decoder. ``state_dict`` keys are HF's minus the ``model.`` prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_q: nn.Module | None = None  # set by compression: a quantized copy of the LM head (edge.compress)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Deterministic initialisation for training from scratch (GPT-2 style scaled residuals)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                s = std / math.sqrt(2 * self.cfg.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * s)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)

    def logits(self, e: torch.Tensor) -> torch.Tensor:
        """LM head on normalised hidden states e [.., D] -> logits [.., V] (the quantized copy if compressed)."""
        return F.linear(e, self.head_weight) if self.head_q is None else self.head_q(e)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: h [B, T, D] -> logits [B, T, V]."""
        return self.logits(self.norm(h))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                past_positions: torch.Tensor | None = None, head: bool = True) -> DecoderOutput:
        """Run all layers. ids [B, T]; past: per-layer (k, v) [B, KV, P, hd] at past_positions [B, P].
        ``head`` False: no logits (a caller that reads the LM head at some positions only; over all of
        them the tiny model's head costs 1.3 layers per token)."""
        b, t = ids.shape
        p = 0 if past is None else past[0][0].shape[2]
        if positions is None:
            positions = torch.arange(p, p + t, device=ids.device).unsqueeze(0).expand(b, t)
        if past_positions is None:
            past_positions = torch.arange(p, device=ids.device).unsqueeze(0).expand(b, p)
        k_pos = torch.cat((past_positions, positions), dim=1)
        mask = attention_mask(positions, k_pos, window=self.cfg.sliding_window)
        if self.training and past is None and self.cfg.sliding_window is None:
            mask = None  # fused causal attention for training
        cos, sin = self.rope(positions)
        h = self.embed(ids)
        hidden, keys, values = [h], [], []
        for i, layer in enumerate(self.layers):
            pk, pv = (past[i] if past is not None else (None, None))
            h, k, v = layer(h, cos, sin, pk, pv, mask)
            hidden.append(h)
            keys.append(k)
            values.append(v)
        return DecoderOutput(self.head(h) if head else None, hidden, keys, values)
