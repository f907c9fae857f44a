"""The candidate-set exit decision: a check that costs a few hundredths of a layer, not an LM head.

A decision exit of a model with a shortlist (``exits.shortlist`` = K > 0) scores its normalised
hidden state against K rows of the LM head only: the K tokens the model's training text uses
most (FR-Spec's frequency-ranked shortlist, ACL 2025). The exit's token is the best of those K; a
token whose final prediction lies outside the shortlist cannot leave early, and if it does, the
certificate counts it as a false exit like any other. The full LM head runs only for rows that
reach the last layer (DESIGN.md, "Decisions must be cheap").

Features [B, F] of one check, the columns of :data:`CANDIDATE_SIGNAL_NAMES`:

- ``cand_p1``, ``cand_margin``: top-1 probability and top-1 minus top-2 of the softmax over the
  K candidate logits (a local distribution: it ignores the mass outside the shortlist);
- ``cand_z1``: the top candidate's raw logit (its scale is what the local softmax loses);
- ``lookup_agree``, ``lookup_len``: whether the candidate equals the token the context lookup
  predicts (:mod:`edge.runtime.lookup`), and the length of that match / MAX_N (0: no match);
- ``agree_prev``, ``agree_run``: agreement with the previous check's token and the run of
  consecutive agreements / number of exits (PABEE's patience);
- ``prev_p1``: the previous check's ``cand_p1`` (SpecEE's "change since the last check"; 0 at the
  first check).

The exit rule scores them with a small MLP per exit (:class:`edge.runtime.rules.ScoreForm`),
exit where the score >= 0. This module is the reference computation in numpy (float32, as the
graphs compute it): the torch, static-cache and portable backends decide with it on the host, the
fused ONNX Runtime graphs compute the same formulas in the segment graph
(:mod:`exporters.ort_fused`), and calibration collects its features with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge.runtime.lookup import MAX_N

CANDIDATE_SIGNAL_NAMES: tuple[str, ...] = ("cand_p1", "cand_margin", "cand_z1", "lookup_agree", "lookup_len",
                                           "agree_prev", "agree_run", "prev_p1")
NUM_FEATURES = len(CANDIDATE_SIGNAL_NAMES)
P1 = 0  # column of cand_p1: what a single-signal (confidence) rule thresholds


@dataclass
class CandidateOut:
    """One check on B rows."""

    token: np.ndarray  # [B] int64: the best candidate's token id
    features: np.ndarray  # [B, F] float32
    run: np.ndarray  # [B] float32: consecutive agreements ending here (the next check reads it)


def shortlist_logits(exit_hidden: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Candidate logits [B, K] = exit_hidden [B, D] @ rows[K, D]^T in float32."""
    return np.asarray(exit_hidden, np.float32) @ np.asarray(rows, np.float32).T


def check(z: np.ndarray, shortlist: np.ndarray, lookup_token: np.ndarray, lookup_len: np.ndarray,
          prev_token: np.ndarray | None, prev_run: np.ndarray | None, prev_p1: np.ndarray | None,
          num_exits: int) -> CandidateOut:
    """The check's token, features and run from candidate logits z [B, K] (float32).

    Args:
        z: candidate logits [B, K].
        shortlist: token ids [K] of the candidates.
        lookup_token: the context lookup's token per row [B] (-1: none).
        lookup_len: its match length per row [B] (0..MAX_N).
        prev_token, prev_run, prev_p1: the previous check's token, run and cand_p1 [B]; None at the
            first check.
        num_exits: the model's number of exits m (agree_run is run / m).
    """
    z = np.asarray(z, np.float32)
    b = z.shape[0]
    top = np.argmax(z, axis=1)
    rows = np.arange(b)
    z1 = z[rows, top]
    e = np.exp(z - z1[:, None])
    total = e.sum(axis=1)
    p1 = (1.0 / total).astype(np.float32)
    if z.shape[1] > 1:
        e2 = e.copy()
        e2[rows, top] = -1.0
        p2 = (e2.max(axis=1) / total).astype(np.float32)
    else:
        p2 = np.zeros(b, np.float32)
    token = np.asarray(shortlist, np.int64)[top]
    zeros = np.zeros(b, np.float32)
    la = (token == np.asarray(lookup_token)).astype(np.float32)
    ll = (np.asarray(lookup_len, np.float32) / np.float32(MAX_N)).astype(np.float32)
    if prev_token is None:
        agree, run, pp = zeros, zeros, zeros
    else:
        agree = (token == prev_token).astype(np.float32)
        run = (agree * (np.asarray(prev_run, np.float32) + np.float32(1))).astype(np.float32)
        pp = np.asarray(prev_p1, np.float32)
    feats = np.stack([p1, p1 - p2, z1.astype(np.float32), la, ll, agree, run / np.float32(num_exits), pp],
                     axis=1).astype(np.float32)
    return CandidateOut(token, feats, run)
