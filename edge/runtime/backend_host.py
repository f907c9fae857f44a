"""What a backend whose graphs stop short of the fused ones computes on the host, in numpy float32, with
the fused graphs' formulas: the additive attention mask over a gathered past (:func:`build_mask`), a
decision exit's rule features, agreement run and linear score (:func:`host_decision`) and a shortlist
model's candidate check (:func:`host_candidates`). The torch reference, the portable graphs (ONNX Runtime
or TensorRT) and the static-cache torch backend call them; the ``onnxruntime`` backend's graphs do it all.
"""
from __future__ import annotations

import numpy as np

from edge.model.candidates import check, shortlist_logits
from edge.runtime.backend import Backend, SegmentOut

NEG = np.finfo(np.float32).min


def build_mask(q_pos: np.ndarray, past_len: np.ndarray, P: int, window: int | None) -> np.ndarray:
    """Additive mask [B, 1, T, P+T]: a query at q_pos [B, T] sees its sequence's cached keys
    0..past_len-1 and the new rows at positions <= its own (and within ``window`` if set)."""
    b = q_pos.shape[0]
    k_pos = np.concatenate([np.broadcast_to(np.arange(P), (b, P)), q_pos], axis=1)  # [B, S]
    k_valid = np.concatenate([np.arange(P)[None, :] < past_len[:, None], np.ones(q_pos.shape, bool)], axis=1)
    allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]  # [B, T, S]
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return np.where(allowed, 0.0, NEG).astype(np.float32)[:, None]


def host_decision(backend: Backend, i: int, out: SegmentOut, prev: SegmentOut | None) -> SegmentOut:
    """Decision exit i's rule features, run and linear score, on the host in float32, as the fused
    graphs compute them: for backends whose graphs do not (the torch reference, the portable graphs
    behind TensorRT, the static-cache torch backend). Fills ``out.features``, ``out.run``, ``out.score``."""
    b = out.exit_hidden.shape[0]
    zeros = np.zeros(b, np.float32)
    first = i == 0
    if prev is None:
        prev = SegmentOut(None, np.zeros_like(out.exit_hidden), None, None, np.full(b, -1), zeros, run=zeros)
    cos = zeros if first else _cosine32(out.exit_hidden, np.asarray(prev.exit_hidden))  # (a device array's copy)
    if backend.spec.gated:
        g = 1.0 / (1.0 + np.exp(-out.gate))
        pg = zeros if first else 1.0 / (1.0 + np.exp(-prev.gate))
        feats = np.stack([g, pg, cos], axis=1).astype(np.float32)
        run = None
    else:
        agree = zeros if first else (out.token == prev.token).astype(np.float32)
        run = zeros if first else agree * (prev.run + 1)
        m = np.float32(len(backend.exit_layers))
        feats = np.concatenate([out.stats, np.stack([agree, run / m, cos], axis=1)], axis=1).astype(np.float32)
    out.features, out.run = feats, run
    out.score = feats @ backend.rule_w[i] + backend.rule_b[i]
    return out


def host_candidates(backend: Backend, i: int, out: SegmentOut, prev: SegmentOut | None,
                    lookup: tuple[np.ndarray, np.ndarray], rows: np.ndarray | None = None,
                    z: np.ndarray | None = None) -> SegmentOut:
    """Shortlist decision exit i on the host (:mod:`edge.model.candidates`, the fused graphs' formulas):
    for backends whose graphs end at the exit hidden (torch, the portable graphs, torch_static). ``rows``:
    the LM head's rows of the shortlist [K, D], or ``z``: the candidate logits [B, K] already computed
    (torch_static computes them on its device). Fills the output's token, features, candidates and score."""
    first = i == 0 or prev is None
    if z is None:
        z = shortlist_logits(out.exit_hidden, rows, backend.shortlist_act_scale)
    c = check(z, backend.shortlist_ids, lookup[0], lookup[1],
              None if first else prev.cand_tokens, None if first else prev.cand_logits, out.exit_hidden)
    out.token, out.features, out.cand_tokens, out.cand_logits = c.token, c.features, c.tokens, c.logits
    out.score = backend.rule_score(i)(c.features)
    return out


def _cosine32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row cosine [B] in float32, 0 where either row is zero (the graphs' formula)."""
    dot, norms = (a * b).sum(1), np.sqrt((a * a).sum(1) * (b * b).sum(1))
    ok = norms > 0
    return np.where(ok, np.clip(dot / np.where(ok, norms, 1), -1, 1), 0).astype(np.float32)
