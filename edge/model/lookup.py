"""Context lookup: what followed the longest recent repeat of the sequence's last tokens.

Prompt-lookup decoding (Saxena 2023; Spec-Bench's "PLD") drafts the next token by matching the
last n tokens of the sequence against earlier text and proposing the token that followed the
match. Here the same lookup is a *feature* of the exit rule: on free-running generations of the
bundled model (code, 2-core x86, 512 prompts), the token that followed the last occurrence of the
longest suffix (n <= 4) equals the full model's next token 57% of the time, and whether an early
exit's token equals it lifts the share of tokens that can leave after layer 1 at a 1% error from
8% to 26% (docs/runtime.md, "What decides an exit").

The same index drafts for mode exact (edge/runtime/speculative.py): :meth:`Lookup.draft` proposes
the k tokens that followed that occurrence (prompt-lookup decoding proper), verified by the full
model in one call; a draft costs no model call.

Where the context has no repeat of at least ``CORPUS_BELOW`` tokens, the feature can come from the
export's corpus n-gram table instead (``table``: :class:`edge.model.ngram.NgramTable`, the model's own
continuations of training-split windows over the text's n-grams): its prediction after the longest
suffix it knows, with that suffix's length as the match length, where that suffix has at least
``CORPUS_MIN`` tokens. With it the certified rule of the demo skipped 0.26 of layer computations held
out instead of 0.20, but erred on 0.84% of held-out tokens against 0.59% (eps 0.9%), so calibration
leaves it off unless asked (``calibrate.lookup_corpus``; docs/runtime.md, stop 49). A threshold table
calibrated with it names the table (its sha256), and the engine reads the same one.

One :class:`Lookup` per sequence, fed every token once (prompt and output alike): ``push`` appends,
the next ``predict`` or ``draft`` indexes what was appended (O(MAX_N) dictionary updates a token) and
looks up O(MAX_N) suffixes, so the engine pays a few microseconds per row and step where it asks, and
an append where it does not. Teacher-forced collection feeds the same tokens in the same order, so
the feature it records is the one the engine computes (:func:`lookup_along`).
"""
from __future__ import annotations

import numpy as np

MAX_N = 4  # longest suffix matched
NONE = -1  # no match: the token id reported
CORPUS_BELOW = 2  # a context match shorter than this gives way to the corpus table's ...
CORPUS_MIN = 3  # ... where the table knows a suffix of at least this many tokens


class Lookup:
    """n-gram index of one token sequence: for n = 1..MAX_N, where the latest earlier occurrence of
    each n-gram ended (the position of the token that followed it). The index is built lazily: ``push``
    only appends, and the first question after it indexes what was appended since (the same index,
    token for token), so a sequence whose lookup is never asked (mode exact at a batch size where
    speculation measured dearer than plain steps, a step whose exits are gated off) pays one append per
    token instead of MAX_N dictionary updates: at batch 16 on the tiny model those updates were 2.8% of
    mode exact's decode time (stop 58, docs/runtime.md)."""

    __slots__ = ("tokens", "_next", "table", "_indexed")

    def __init__(self, tokens: list[int] | None = None, table=None) -> None:
        """``table``: the corpus n-gram table :meth:`predict` falls back to (None: the context only)."""
        self.tokens: list[int] = [int(t) for t in tokens or ()]
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_N)]
        self.table = table
        self._indexed = 0  # tokens[:_indexed] have their n-grams (those ending before them) in _next

    def push(self, token: int) -> None:
        """Append ``token``: the n-grams ending just before it point at it once the index catches up."""
        self.tokens.append(int(token))

    def _catch_up(self) -> None:
        """Index every token appended since the last question, in order."""
        toks, nxt = self.tokens, self._next
        for end in range(self._indexed, len(toks)):
            for n in range(1, min(MAX_N, end) + 1):
                nxt[n - 1][tuple(toks[end - n:end])] = end
        self._indexed = len(toks)

    def predict(self) -> tuple[int, int]:
        """(token, n): the token that followed the latest earlier occurrence of the longest suffix of
        length n <= MAX_N that occurred before; (:data:`NONE`, 0) when even the last token is new. With a
        ``table``, where that n is below :data:`CORPUS_BELOW`, the table's successor of the longest suffix it
        knows (n: that suffix's length) if that suffix has at least :data:`CORPUS_MIN` tokens."""
        at, n = self._match()
        if n < CORPUS_BELOW and self.table is not None:
            drafts, m = self.table.draft(self.tokens, 1)
            if drafts and m >= CORPUS_MIN:
                return drafts[0], m
        return (self.tokens[at], n) if n else (NONE, 0)

    def draft(self, k: int) -> tuple[list[int], int]:
        """(tokens, n): ``k`` tokens that followed the latest earlier occurrence of the longest suffix (n as
        in :meth:`predict`; the first token is the one it predicts); ([], 0) when even the last token is new.
        Where that occurrence is near the end, its continuation runs on into the drafts themselves (a copy
        that overlaps itself, as LZ77's does): a span that repeats drafts its next repetition too."""
        at, n = self._match()
        if not n:
            return [], 0
        toks = self.tokens
        out = toks[at:at + k]
        back = len(toks) - at  # the repetition's period: draft j is the token `back` before it
        while len(out) < k:
            out.append(out[len(out) - back])
        return out, n

    def _match(self) -> tuple[int, int]:
        if self._indexed < len(self.tokens):
            self._catch_up()
        toks = self.tokens
        end = len(toks)
        for n in range(min(MAX_N, end), 0, -1):
            at = self._next[n - 1].get(tuple(toks[end - n:end]))
            if at is not None:
                return at, n
        return 0, 0


def lookup_along(seq: np.ndarray, first: int, last: int, table=None) -> tuple[np.ndarray, np.ndarray]:
    """The lookup's prediction at every position p in [first, last) of ``seq`` (int [L]): what
    :meth:`Lookup.predict` gives after tokens seq[0..p] were pushed, i.e. the feature of the step that
    feeds seq[p] and predicts seq[p + 1]. Returns (token int64 [last - first], n int64 [...])."""
    lk = Lookup([int(t) for t in seq[:first]], table)
    toks = np.empty(last - first, np.int64)
    lens = np.empty(last - first, np.int64)
    for i, p in enumerate(range(first, last)):
        lk.push(int(seq[p]))
        toks[i], lens[i] = lk.predict()
    return toks, lens
