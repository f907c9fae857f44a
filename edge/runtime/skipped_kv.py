"""The keys / values of the layers a row skipped when it exited early: later tokens still need them.

``propagate`` (CALM): the exit's residual goes through each skipped layer's K/V projections at once.
``defer`` (EE-LLM style recomputation): the exited row is kept pending (``_Pending``) and run through the
skipped layers, for real, together with the sequence's next token when that token reaches them. Pending
rows of a sequence always form a suffix whose next segment does not increase with position, so at each
segment the rows that must run are a contiguous suffix plus the new token. At the last segment the head
runs on the rows whose exit is to be judged: the full model's verdict on that exit (``Verdict``), which
the engine delivers (``verdict``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from edge.runtime.backend import Backend, SegmentOut
from edge.runtime.engine_config import KVMode
from edge.runtime.request import _Pending, _Seq

# the engine's delivery of the full model's verdict on a pending row (``Engine._judge``)
Verdicts = Callable[[_Seq, _Pending, "int | None"], None]


def fill_skipped(backend: Backend, kv_mode: KVMode, exited: list[_Seq], i: int, h: np.ndarray, slots: np.ndarray,
                 pos: np.ndarray, decided: list[tuple[_Seq, int, int]]) -> None:
    """K/V of segments i+1.. for rows that exited after segment i (h [B, D]: their residual; ``decided``:
    their (sequence, token, layer), for the verdict deferral gives on greedy tokens)."""
    if kv_mode is KVMode.DEFER:
        for s, row, (_, token, layer) in zip(exited, h, decided):
            judged = s.req.temperature == 0 and s.req.on_verdict is not None  # the head row only if asked
            s.pending.append(_Pending(s.length, row.copy(), i + 1, token if judged else -1, len(s.tokens), layer))
        return
    backend.kvfill(i + 1, h, slots, pos)


def with_deferred(backend: Backend, i: int, s: _Seq, x: np.ndarray, slots: np.ndarray, start: np.ndarray,
                  prev: SegmentOut | None, lookup: tuple[np.ndarray, np.ndarray] | None,
                  verdict: Verdicts) -> SegmentOut:
    """Segment i for one sequence: its deferred rows that segment i must see (the newest ones, at the
    positions just before the new token's) and the new token, in one call of T rows."""
    rows = [p for p in s.pending if p.next_seg <= i]
    if not rows:
        return backend.segment(i, x, slots, start, prev, lookup=lookup)
    h = np.concatenate([np.stack([p.hidden for p in rows])[None], x], axis=1)  # [1, k + 1, D]
    last = i == len(backend.segments) - 1
    # at the last segment the head runs on the deferred rows too (their verdicts: one more head row)
    judge = last and any(p.token >= 0 for p in rows)
    n = len(rows) + 1 if judge else 1
    out = backend.segment(i, h, slots, start - len(rows), prev, lookup=lookup, rows=n)
    for q, p in enumerate(rows):
        p.next_seg = i + 1
        if out.hidden is not None:
            p.hidden = out.hidden[0, q].copy()
        if judge:
            verdict(s, p, int(out.token[q]))
    if last:
        s.pending = [p for p in s.pending if p.next_seg < i + 1]
    hidden = None if out.hidden is None else out.hidden[:, -1:]
    if n == 1:
        return SegmentOut(hidden, out.exit_hidden, out.logits, out.stats, out.token, out.gate, out.features,
                          out.score, out.run, out.cand_tokens, out.cand_logits)
    # the last segment: no decision outputs
    stats = None if out.stats is None else out.stats[-1:]
    return SegmentOut(hidden, out.exit_hidden[-1:], out.logits[-1:], stats, out.token[-1:])


def catch_up(backend: Backend, i: int, act: list[_Seq], x: np.ndarray, slots: np.ndarray, start: np.ndarray,
             verdict: Verdicts) -> np.ndarray:
    """Deferred rows that segment i must see before the new tokens: run them first, oldest first,
    in batched one-row calls (phase k holds every sequence's k-th such row). Returns the new
    tokens' input, copied if a phase call could reuse its buffer."""
    rows = [[p for p in s.pending if p.next_seg <= i] for s in act]
    depth = max(len(r) for r in rows)
    if depth == 0:
        return x
    x = x.copy()
    nseg = len(backend.segments)
    for k in range(depth):
        sel = [b for b, r in enumerate(rows) if len(r) > k]
        ps = [rows[b][k] for b in sel]
        h = np.stack([p.hidden for p in ps])[:, None]  # [B_k, 1, D]
        # the last segment's head runs where a row is to be judged (its verdict); no decision is read
        judge = i == nseg - 1 and any(p.token >= 0 for p in ps)
        out = backend.segment(i, h, slots[sel], np.array([p.pos for p in ps]), decide=judge)
        for q, (b, p) in enumerate(zip(sel, ps)):
            p.next_seg = i + 1
            if out.hidden is not None:
                p.hidden = out.hidden[q, 0].copy()
            if judge:
                verdict(act[b], p, int(out.token[q]))
    if i == nseg - 1:
        for s in act:
            s.pending = [p for p in s.pending if p.next_seg < nseg]
    return x
