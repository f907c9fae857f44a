"""The candidate-set exit decision: a check that costs a few hundredths of a layer, not an LM head.

A decision exit of a model with a shortlist (``exits.shortlist`` = K > 0) scores its normalised
hidden state against K rows of the LM head only: the K tokens the model's training text uses
most (FR-Spec's frequency-ranked shortlist, ACL 2025). The exit's token is the best of those K; a
token whose final prediction lies outside the shortlist cannot leave early, and if it does, the
certificate counts it as a false exit like any other. The full LM head runs only for rows that
reach the last layer (DESIGN.md, "Decisions must be cheap").

Features [B, F] of one check, F = 9 + D, the columns of :func:`signal_names`:

- ``cand_z1``, ``cand_z2``: the two best candidate logits. No softmax over the candidates: on the
  bundled model's free-running text a local softmax added nothing to how well the checks rank (layers
  skipped at 0.25% / 0.45% / 0.9% error: 0.216 / 0.257 / 0.308 without it, 0.173 / 0.227 / 0.300 with
  it, K = 256, exits 1-8), and it cost three graph nodes and a pass over the K logits;
- ``lookup_agree1``, ``lookup_agree2``: whether the first / second candidate is the token the
  context lookup predicts (:mod:`edge.model.lookup`); ``lookup_len``: the length of that match /
  MAX_N (0: no match);
- ``agree_prev1``, ``agree_prev2``, ``prev_z1``, ``prev_z2``: whether the first / second candidate
  is the previous check's, and the previous check's two logits (SpecEE's features across checks,
  "the change since the last check"; zeros at the first check);
- ``exit_hidden_0`` .. ``exit_hidden_{D-1}``: the normalised exit hidden state itself, the LM head's
  input (a probe of the hidden state, as CALM's learned classifier and SpecEE's predictor read it), so
  the rule's MLP sees what the candidate logits were computed from. On the shipped model's free-running
  text the candidate features alone rank the checks poorly: at exits 1, 2, 4 with K = 256, a perfect
  rule could skip 52% of layer computations and the best MLP of the nine named features 13.5% at 0.6%
  false exits, the same MLP with the full softmax's confidence added 13.8%, with the hidden state
  21.4% (weights fitted on calibration-split continuations, judged on test-split ones; docs/runtime.md).
  It costs the rule's first layer D more rows (a [B, 9 + D] x [9 + D, H] product, about an eighth of
  the shortlist's [B, D] x [D, K]) and no graph node: the hidden state joins the features' Concat.

Everything per row is a pair (top-2 tokens, top-2 logits) so that the graphs need no
reshape or slice between nodes: at batch 1 a node of ONNX Runtime costs a few microseconds
whatever it computes, and the node count is the check's price (docs/runtime.md).

The exit rule scores them with a small MLP per exit (:class:`edge.runtime.rules.ScoreForm`),
exit where the score >= 0. This module is the reference computation in numpy (float32, as the
graphs compute it): the torch, static-cache and portable backends decide with it on the host, the
fused ONNX Runtime graphs compute the same formulas in the segment graph
(:func:`exporters.ort_exits.decision_shortlist`), and calibration collects its features with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge.model.lookup import MAX_N

CANDIDATE_SIGNAL_NAMES: tuple[str, ...] = ("cand_z1", "cand_z2", "lookup_agree1", "lookup_agree2", "lookup_len",
                                           "agree_prev1", "agree_prev2", "prev_z1", "prev_z2")
NUM_NAMED = len(CANDIDATE_SIGNAL_NAMES)  # the named features; the exit hidden state's D columns follow them
HIDDEN_PREFIX = "exit_hidden_"
LOOKUP_LEN = CANDIDATE_SIGNAL_NAMES.index("lookup_len")  # column of the lookup's match length / MAX_N
Z1 = 0  # column of cand_z1: what a single-signal (confidence) rule thresholds


def num_features(hidden_size: int) -> int:
    """Columns of a check's features for a model of hidden size D: the named ones, then the exit hidden."""
    return NUM_NAMED + int(hidden_size)


def signal_names(hidden_size: int) -> tuple[str, ...]:
    """The check's feature names for hidden size D (a threshold table records them)."""
    return CANDIDATE_SIGNAL_NAMES + tuple(f"{HIDDEN_PREFIX}{i}" for i in range(int(hidden_size)))


def is_signal_names(names) -> bool:
    """Whether ``names`` are a candidate check's features (:func:`signal_names` of some hidden size >= 1)."""
    names = tuple(names)
    return len(names) > NUM_NAMED and names == signal_names(len(names) - NUM_NAMED)


@dataclass
class CandidateOut:
    """One check on B rows."""

    tokens: np.ndarray  # [B, 2] int64: the two best candidates' token ids (column 0: the check's token)
    logits: np.ndarray  # [B, 2] float32: their logits (the next check reads both)
    features: np.ndarray  # [B, F] float32

    @property
    def token(self) -> np.ndarray:
        return self.tokens[:, 0]


def shortlist_logits(exit_hidden: np.ndarray, rows: np.ndarray, act_scale: float | None = None) -> np.ndarray:
    """Candidate logits [B, K] = exit_hidden [B, D] @ rows[K, D]^T in float32; with ``act_scale`` (a W8A8
    head's activation scale: :meth:`edge.model.exits.MultiExitModel.shortlist_act_scale`) the exit hidden
    quantized first as that head quantizes its input (x / scale, round half to even, clamp to int8), so the
    candidates are scored as the head would score them."""
    x = np.asarray(exit_hidden, np.float32)
    if act_scale is not None:
        s = np.float32(act_scale)
        x = np.clip(np.rint(x / s), -128, 127).astype(np.float32) * s
    return x @ np.asarray(rows, np.float32).T


def check(z: np.ndarray, shortlist: np.ndarray, lookup_token: np.ndarray, lookup_len: np.ndarray,
          prev_tokens: np.ndarray | None, prev_logits: np.ndarray | None, hidden: np.ndarray) -> CandidateOut:
    """The check's two best candidates, their logits and the features from candidate logits z [B, K]
    and the exit hidden they were computed from.

    Args:
        z: candidate logits [B, K], K >= 2.
        shortlist: token ids [K] of the candidates.
        lookup_token: the context lookup's token per row [B] (-1: none).
        lookup_len: its match length / MAX_N per row [B] (:func:`lookup_feature`).
        prev_tokens, prev_logits: the previous check's [B, 2]; None at the first check.
        hidden: the normalised exit hidden [B, D] (z = hidden @ rows^T).
    """
    z = np.asarray(z, np.float32)
    b = z.shape[0]
    rows = np.arange(b)
    top = np.argmax(z, axis=1)  # the lowest index on ties, as TopK
    rest = z.copy()
    rest[rows, top] = -np.inf
    second = np.argmax(rest, axis=1)
    vals = np.stack([z[rows, top], z[rows, second]], axis=1)  # [B, 2]
    tokens = np.asarray(shortlist, np.int64)[np.stack([top, second], axis=1)]  # [B, 2]
    la = (tokens == np.asarray(lookup_token, np.int64)[:, None]).astype(np.float32)
    ll = np.asarray(lookup_len, np.float32)[:, None]
    if prev_tokens is None:
        agree, pz = np.zeros((b, 2), np.float32), np.zeros((b, 2), np.float32)
    else:
        agree, pz = (tokens == prev_tokens).astype(np.float32), np.asarray(prev_logits, np.float32)
    feats = np.concatenate([vals, la, ll, agree, pz, np.asarray(hidden, np.float32)], axis=1).astype(np.float32)
    return CandidateOut(tokens, vals, feats)


def lookup_feature(n: np.ndarray) -> np.ndarray:
    """The ``lookup_len`` feature of match lengths n (0..MAX_N): n / MAX_N, float32."""
    return (np.asarray(n, np.float32) * np.float32(1.0 / MAX_N)).astype(np.float32)
