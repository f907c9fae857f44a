"""Token importance in prefill: low-importance prompt tokens stop being computed past a layer.

The layers before ``skip_from_layer`` run on every prompt token and score it. Past that layer only
the kept tokens (a budget, ``keep_fraction`` of the prompt, plus the always-kept first and last
tokens) run attention and MLP; a skipped token's hidden state is frozen where it stopped, and each
deeper layer still stores its keys and values, projected from the frozen state with
``layer.kv_only`` (CALM's state propagation, Schuster et al. 2022), so later tokens attend to it.
Nothing is removed from the cache: the saving is compute, not memory (LazyLLM, Fu et al. 2024,
prunes prompt tokens in prefill the same way, from attention scores).

Scores:
  * attention received, accumulated over the scoring layers (H2O's "heavy hitters", Zhang et al.
    2023), each key's sum divided by the number of queries that can see it: under a causal mask
    key j is visible to T - j queries, so raw sums favour early tokens;
  * value norms: a token's contribution to another token's output is alpha * W_o v, so a token with
    a small value vector adds little however much attention it gets (Kobayashi et al. 2020,
    "Attention is Not Only a Weight"; Guo et al. 2024, "Value Also Matters");
  * combined: the mean of the two scores' ranks (scale-free, neither dominates);
  * recency: position (the last tokens win), the baseline the scores have to beat.
With ``observe_last = n`` the attention counted is only the last n queries' (SnapKV's observation
window, Li et al. 2024): what the prompt's end reads predicts what the next tokens will read.
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from edge.core.errors import ConfigError, RequestError
from edge.model.config import ModelConfig
from edge.model.decoder import Decoder, DecoderLayer, apply_rope, attention_mask
from edge.model.exits import MultiExitModel


class ImportanceScore(str, enum.Enum):  # what ranks the prompt tokens (module docstring)
    ATTENTION = "attention"
    NORM = "norm"
    COMBINED = "combined"
    RECENCY = "recency"  # baseline


_ATTN = (ImportanceScore.ATTENTION, ImportanceScore.COMBINED)  # the scores that read attention


@dataclass
class TokenImportanceConfig:
    """Where tokens stop being computed and how many keep going."""

    skip_from_layer: int  # 0-based; layers [0, skip_from_layer) run on all tokens and score them
    keep_fraction: float  # share of prompt tokens computed past skip_from_layer, in (0, 1]
    score: str = ImportanceScore.COMBINED.value  # "attention" | "norm" | "combined" | "recency"
    keep_last: int = 8  # always kept: the next-token prediction reads the last one
    keep_first: int = 1  # always kept: the attention sink (Xiao et al. 2023, StreamingLLM)
    observe_last: int = 0  # attention received from the last n queries only; 0 = from all queries

    def __post_init__(self) -> None:
        f = self.keep_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:  # NaN fails too
            raise ConfigError(f"token_importance.keep_fraction must be a number in (0, 1], got {f!r}")
        try:
            self.score = ImportanceScore(self.score)
        except ValueError:
            raise ConfigError(f"token_importance.score must be one of {[s.value for s in ImportanceScore]}, "
                              f"got {self.score!r}") from None
        # skip_from_layer >= 1: at least one layer runs on every token to score it
        for name, low in (("skip_from_layer", 1), ("keep_last", 1), ("keep_first", 0), ("observe_last", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"token_importance.{name} must be an integer >= {low}, got {v!r}")

    def to_dict(self) -> dict:
        return {**asdict(self), "score": ImportanceScore(self.score).value}


# ---- pure scoring ---------------------------------------------------------------------------

def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention probabilities, float32 [B, H, T, S].

    Args: q [B, H, T, hd] and k [B, KV, S, hd], both rotated; mask [B, 1, T, S] additive. GQA: KV
    head j serves the consecutive query heads j*rep .. j*rep + rep - 1, rep = H // KV.
    """
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, H, S, hd]
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5 + mask  # [B, H, T, S]
    return torch.softmax(scores, dim=-1)


def attention_received(probs: torch.Tensor, mask: torch.Tensor, last: int = 0) -> torch.Tensor:
    """Mean attention a key gets from one head and one query that can see it: [B, S].

    Args: probs [B, H, T, S]; mask [B, 1, T, S] additive (a hidden entry is the float32 minimum);
    last: count only the last ``last`` queries (0 = all).
    """
    if last:
        probs, mask = probs[:, :, -last:], mask[:, :, -last:]
    visible = (mask > torch.finfo(torch.float32).min / 2).sum(dim=(1, 2)).clamp_min(1)  # [B, S]
    return probs.float().sum(dim=(1, 2)) / (probs.shape[1] * visible)


def value_norm(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer values [B, KV, T, hd] -> [B, T]: L2 norm of each token's value vector, mean over KV
    heads and layers."""
    return torch.stack([v.float().norm(dim=-1).mean(dim=1) for v in values]).mean(0)


def rank_average(*scores: torch.Tensor) -> torch.Tensor:
    """Scores [B, T] -> [B, T]: the mean of their ranks scaled to [0, 1] (1 = highest; ties by position)."""
    t = scores[0].shape[-1]
    ranks = [s.argsort(dim=-1, stable=True).argsort(dim=-1).float() / max(t - 1, 1) for s in scores]
    return torch.stack(ranks).mean(0)


def importance(score: ImportanceScore | str, received: Sequence[torch.Tensor],
               values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Importance [B, T] (higher = keep) from the scoring layers' attention_received [B, T] each and
    values [B, KV, T, hd] each."""
    score = ImportanceScore(score)
    if score is ImportanceScore.RECENCY:
        return torch.arange(values[0].shape[2], dtype=torch.float32).expand(values[0].shape[0], -1)
    if score is ImportanceScore.NORM:
        return value_norm(values)
    attn = torch.stack(list(received)).mean(0)  # [B, T]
    return attn if score is ImportanceScore.ATTENTION else rank_average(attn, value_norm(values))


def forced_mask(t: int, cfg: TokenImportanceConfig) -> torch.Tensor:
    """[T] bool: the first keep_first and last keep_last prompt tokens."""
    forced = torch.zeros(t, dtype=torch.bool)
    forced[:cfg.keep_first] = True
    forced[max(t - cfg.keep_last, 0):] = True
    return forced


def keep_count(t: int, cfg: TokenImportanceConfig) -> int:
    """Tokens computed past skip_from_layer: ceil(keep_fraction * T), at least the forced ones, at most T."""
    budget = math.ceil(cfg.keep_fraction * t - 1e-9)  # 1e-9: 0.3 * 10 is 3.0000000000000004 in floats
    return min(t, max(budget, int(forced_mask(t, cfg).sum())))


def select_kept(scores: torch.Tensor, cfg: TokenImportanceConfig) -> torch.Tensor:
    """[T] scores -> [T] bool: the forced tokens, then the highest scores (lower position on ties)."""
    t = scores.shape[0]
    ranked = torch.where(forced_mask(t, cfg), torch.inf, scores.float())
    order = torch.sort(ranked, descending=True, stable=True).indices
    kept = torch.zeros(t, dtype=torch.bool)
    kept[order[:keep_count(t, cfg)]] = True
    return kept


def prefill_flops(cfg: ModelConfig, t: int, kept_per_layer: Sequence[int]) -> int:
    """Matmul FLOPs (2 m n k each) of a prefill of ``t`` tokens that computes ``kept_per_layer[i]`` of
    them fully at layer i and only the K/V projections (kv_only) of the others.

    Per fully computed token: q, k, v, o projections and the three SwiGLU matrices; attention scores
    and probs @ values against all ``t`` keys (dense, masked entries included, as the decoder computes
    them). Plus the LM head on the last token, the only logits a prefill needs. Norms, softmax and
    RoPE are not matmuls and are left out.
    """
    if len(kept_per_layer) != cfg.num_layers or any(not 0 <= n <= t for n in kept_per_layer):
        raise ConfigError(f"kept_per_layer must give {cfg.num_layers} counts in [0, {t}], got {list(kept_per_layer)}")
    d, hq, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.kv_dim, cfg.intermediate_size
    total = 2 * d * cfg.vocab_size
    for n in kept_per_layer:
        total += 2 * n * d * (hq + 2 * kv) + 2 * n * hq * d + 3 * 2 * n * d * ff  # q k v, o, gate up down
        total += 2 * 2 * n * t * hq  # q . k and probs @ v, every query head over all t keys
        total += 2 * (t - n) * d * 2 * kv  # kv_only of the skipped tokens
    return total


def scoring_flops(cfg: ModelConfig, t: int, tcfg: TokenImportanceConfig) -> int:
    """Extra work of scoring over the layers before skip_from_layer: column sums of the attention
    probabilities the layers already form (H x queries x T adds each), value norms (2 KV*hd per token)."""
    score = ImportanceScore(tcfg.score)
    attn = cfg.num_heads * min(tcfg.observe_last or t, t) * t if score in _ATTN else 0
    norm = 2 * t * cfg.kv_dim if score in (ImportanceScore.NORM, ImportanceScore.COMBINED) else 0
    return tcfg.skip_from_layer * (attn + norm)


# ---- prefill ------------------------------------------------------------------------------

@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, V] final-layer logits of the last prompt token
    kept: torch.Tensor  # [T] bool: computed past skip_from_layer
    scores: torch.Tensor  # [T] importance, higher = more important
    keys: list[torch.Tensor]  # per layer [1, KV, T, hd], in position order 0..T-1
    values: list[torch.Tensor]
    frozen: torch.Tensor  # [1, T, D] hidden state entering layer skip_from_layer (skipped tokens keep it)
    kept_per_layer: list[int]
    full_flops: int  # prefill_flops with every token computed at every layer
    skip_flops: int  # prefill_flops of this prefill plus the scoring

    @property
    def flops_saved_frac(self) -> float:
        return 1.0 - self.skip_flops / self.full_flops

    @property
    def cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v), what Decoder.forward takes as ``past`` to continue decoding."""
        return list(zip(self.keys, self.values))


def _decoder(model: MultiExitModel | Decoder) -> Decoder:
    dec = model.backbone if isinstance(model, MultiExitModel) else model
    if not isinstance(dec, Decoder):
        raise ConfigError(f"expected a MultiExitModel or Decoder, got {type(model).__name__}")
    return dec


def _layer_with_probs(layer: DecoderLayer, h, cos, sin, mask):
    """DecoderLayer.forward on all tokens (no past) that also returns its attention probabilities:
    (h [B, T, D], k, v [B, KV, T, hd], probs [B, H, T, T])."""
    att = layer.self_attn
    b, t, _ = h.shape
    x = layer.input_layernorm(h)
    q = apply_rope(att.q_proj(x).view(b, t, att.num_heads, att.head_dim).transpose(1, 2), cos, sin)  # [B, H, T, hd]
    k, v = att.kv(x, cos, sin)  # [B, KV, T, hd]
    probs = attention_probs(q, k, mask)  # [B, H, T, T]
    out = probs.to(v.dtype) @ v.repeat_interleave(att.num_heads // att.num_kv_heads, dim=1)  # [B, H, T, hd]
    h = h + att.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k, v, probs


@torch.no_grad()
def prefill_with_skipping(model: MultiExitModel | Decoder, ids: torch.Tensor,
                          cfg: TokenImportanceConfig) -> PrefillResult:
    """Prefill ``ids`` [1, T] computing only the important tokens past ``cfg.skip_from_layer``.

    Returns: a :class:`PrefillResult` (last-token logits, kept mask, per-layer K/V, FLOPs).
    Raises: ConfigError if skip_from_layer is past the model's depth; RequestError if ids is not [1, T>0].
    """
    dec = _decoder(model)
    mc, s = dec.cfg, cfg.skip_from_layer
    if s > mc.num_layers:
        raise ConfigError(f"token_importance.skip_from_layer={s} is past the model's {mc.num_layers} layers "
                          f"(use {mc.num_layers} to skip nothing)")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise RequestError(f"ids must be one non-empty prompt [1, T], got shape {tuple(ids.shape)}", field="ids")
    t = ids.shape[1]
    pos = torch.arange(t).unsqueeze(0)  # [1, T]
    cos, sin = dec.rope(pos)  # [1, 1, T, hd]
    mask = attention_mask(pos, pos, window=mc.sliding_window)  # [1, 1, T, T]
    h = dec.embed(ids)  # [1, T, D]
    keys, values, received = [], [], []
    for layer in dec.layers[:s]:
        if cfg.score in _ATTN:
            h, k, v, probs = _layer_with_probs(layer, h, cos, sin, mask)
            received.append(attention_received(probs, mask, cfg.observe_last))
        else:
            h, k, v = layer(h, cos, sin, None, None, mask)
        keys.append(k)
        values.append(v)
    scores = importance(cfg.score, received, values)[0]  # [T]
    kept = select_kept(scores, cfg) if s < mc.num_layers else torch.ones(t, dtype=torch.bool)
    ki, si = kept.nonzero()[:, 0], (~kept).nonzero()[:, 0]  # ascending positions
    frozen, hk = h, h[:, ki]  # [1, T, D], [1, n, D]
    order = torch.cat((si, ki)).argsort()  # [skipped, kept] rows -> position order
    cos_k, sin_k, cos_s, sin_s = cos[:, :, ki], sin[:, :, ki], cos[:, :, si], sin[:, :, si]
    # kept queries against [skipped keys, kept keys]; the mask reads positions, so the order is free
    mask_k = attention_mask(pos[:, ki], torch.cat((pos[:, si], pos[:, ki]), 1), window=mc.sliding_window)
    for layer in dec.layers[s:]:
        ks = vs = None
        if si.numel():
            ks, vs = layer.kv_only(frozen[:, si], cos_s, sin_s)  # [1, KV, T - n, hd]
        hk, kk, vk = layer(hk, cos_k, sin_k, ks, vs, mask_k)  # [1, n, D], [1, KV, n, hd]
        keys.append((kk if ks is None else torch.cat((ks, kk), 2))[:, :, order])  # [1, KV, T, hd]
        values.append((vk if vs is None else torch.cat((vs, vk), 2))[:, :, order])
    kept_per_layer = [t] * s + [int(ki.numel())] * (mc.num_layers - s)
    return PrefillResult(
        logits=dec.head(hk[:, -1:])[:, 0], kept=kept, scores=scores, keys=keys, values=values, frozen=frozen,
        kept_per_layer=kept_per_layer, full_flops=prefill_flops(mc, t, [t] * mc.num_layers),
        skip_flops=prefill_flops(mc, t, kept_per_layer) + scoring_flops(mc, t, cfg),
    )


# ---- quality on held-out windows ------------------------------------------------------------

@dataclass
class TokenImportanceReport:
    config: TokenImportanceConfig
    n_windows: int
    prompt_len: int
    continuation: int
    kept_per_layer: list[int]
    full_flops: int  # per prompt
    skip_flops: int
    flops_saved_frac: float
    kl_mean: float  # KL(full || skipping) of the next-token distribution at the prompt end, nats
    top1_agreement: float  # same argmax at the prompt end
    cont_kl_mean: float  # the same over all continuation predictions (teacher-forced on each cache)
    cont_top1_agreement: float
    ppl_full: float  # teacher-forced perplexity of the continuation on the full prefill's cache
    ppl_skip: float  # ... on the skipping prefill's cache
    ppl_ratio: float  # ppl_skip / ppl_full

    def to_dict(self) -> dict:
        return {**asdict(self), "config": self.config.to_dict()}


def _continuation_logits(dec: Decoder, first: torch.Tensor, cache, cont: torch.Tensor) -> torch.Tensor:
    """Logits [C, V] predicting cont [1, C]: ``first`` [1, V] from the prefill, the rest decoded full
    depth, teacher-forced, on top of ``cache``."""
    if cont.shape[1] == 1:
        return first.float()
    rest = dec(cont[:, :-1], past=cache).logits[0]  # [C - 1, V]
    return torch.cat((first, rest), 0).float()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row of logits [N, V] -> [N], nats."""
    lp, lq = F.log_softmax(p_logits.float(), -1), F.log_softmax(q_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@torch.no_grad()
def evaluate_token_importance(model: MultiExitModel | Decoder, windows_ids, cfg: TokenImportanceConfig,
                              continuation: int) -> TokenImportanceReport:
    """Quality and FLOPs of skipping prefill on held-out windows.

    Each window [T] splits into a prompt (the first T - continuation tokens), prefilled with skipping
    and in full (Decoder.forward), and a continuation scored teacher-forced at full depth on each
    prefill's cache: the skipped tokens' deeper K/V are what later tokens read.

    Args: windows_ids [N, T] token ids (array or tensor); continuation in [1, T - 1].
    Raises: ConfigError on a bad shape or continuation, or skip_from_layer past the model's depth.
    """
    dec = _decoder(model)
    ids = torch.as_tensor(np.asarray(windows_ids), dtype=torch.long)
    if ids.dim() != 2 or ids.shape[0] == 0 or not 1 <= continuation < ids.shape[1]:
        raise ConfigError(f"windows_ids must be [N>0, T] with 1 <= continuation < T; got shape "
                          f"{tuple(ids.shape)} and continuation={continuation}")
    p = ids.shape[1] - continuation
    kls, agree, nll_full, nll_skip = [], [], 0.0, 0.0
    for row in ids:
        prompt, cont = row[None, :p], row[None, p:]  # [1, P], [1, C]
        full = dec(prompt)
        res = prefill_with_skipping(dec, prompt, cfg)
        lf = _continuation_logits(dec, full.logits[:, -1], list(zip(full.keys, full.values)), cont)  # [C, V]
        ls = _continuation_logits(dec, res.logits, res.cache, cont)
        kls.append(_kl(lf, ls))  # [C]
        agree.append((lf.argmax(-1) == ls.argmax(-1)).float())  # [C]
        nll_full += float(F.cross_entropy(lf, cont[0], reduction="sum"))
        nll_skip += float(F.cross_entropy(ls, cont[0], reduction="sum"))
    kl, same, n_tok = torch.stack(kls), torch.stack(agree), ids.shape[0] * continuation  # [N, C]
    ppl_full, ppl_skip = math.exp(nll_full / n_tok), math.exp(nll_skip / n_tok)
    return TokenImportanceReport(
        config=cfg, n_windows=ids.shape[0], prompt_len=p, continuation=continuation,
        kept_per_layer=res.kept_per_layer, full_flops=res.full_flops, skip_flops=res.skip_flops,
        flops_saved_frac=res.flops_saved_frac, kl_mean=float(kl[:, 0].mean()), top1_agreement=float(same[:, 0].mean()),
        cont_kl_mean=float(kl.mean()), cont_top1_agreement=float(same.mean()), ppl_full=ppl_full, ppl_skip=ppl_skip,
        ppl_ratio=ppl_skip / ppl_full,
    )
