"""Corpus n-gram drafts: what the training text most often wrote after the sequence's last tokens.

Retrieval drafts (REST, He et al. 2024) propose continuations found in a datastore instead of in the
sequence itself. Here the datastore is a table built once from the training split (the text the
model learned from; never the calibration or test split): for n = 1..MAX_N, each n-gram that occurs
at least ``min_count`` times maps to its most frequent next token, kept where that token follows it
in at least ``min_share`` of its occurrences. A draft chains the table greedily from the sequence's
longest known suffix (n >= ``min_n``). Mode exact verifies the drafts (edge/runtime/speculative.py):
a poor table costs speed, never exactness.

The table is a file of packed keys and their tokens (``.npz``) that the export writes into the exits
export's folder, built with the run's tokenizer (so it goes with the graphs it was exported beside);
:class:`NgramTable` keeps the sorted arrays (about 12 bytes an entry: the demo's 700k entries are
8 MiB, where Python dicts took 92 MiB) and finds a key by binary search.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from edge.core.errors import ConfigError

MAX_N = 3
FORMAT = 1
NGRAM_FILE = "ngram.npz"  # its name in an export folder (edge/runtime/graphs.py NGRAM_TABLE)


def _pack(windows: np.ndarray, vocab: int) -> np.ndarray:
    """[M, n] int64 token windows -> [M] int64 keys (base-``vocab`` digits)."""
    key = np.zeros(len(windows), np.int64)
    for j in range(windows.shape[1]):
        key = key * vocab + windows[:, j]
    return key


def build_table(sequences: Iterable[np.ndarray], vocab: int, min_count: int = 2, min_share: float = 0.5
                ) -> dict[str, np.ndarray]:
    """The arrays of a table (``keys_<n>``, ``next_<n>``, sorted by key, n = 1..MAX_N) from token
    sequences (1-D int arrays of one document each). ``vocab`` ** MAX_N must fit in int64."""
    if vocab ** (MAX_N + 1) >= 2 ** 63:
        raise ConfigError(f"a vocabulary of {vocab} tokens is too large for {MAX_N}-gram keys packed in int64")
    seqs = [np.asarray(s, np.int64) for s in sequences]
    out: dict[str, np.ndarray] = {"vocab": np.array(vocab), "format": np.array(FORMAT)}
    for n in range(1, MAX_N + 1):
        pairs = []
        for s in seqs:
            if len(s) > n:
                win = np.lib.stride_tricks.sliding_window_view(s, n + 1)  # [M, n + 1]: context and next
                pairs.append(_pack(win, vocab))
        if not pairs:
            out[f"keys_{n}"], out[f"next_{n}"] = np.zeros(0, np.int64), np.zeros(0, np.int32)
            continue
        pair, count = np.unique(np.concatenate(pairs), return_counts=True)  # (context, next) -> occurrences
        ctx, nxt = pair // vocab, pair % vocab
        # per context: its total, and its most frequent next token (sorted by context, then count)
        order = np.lexsort((-count, ctx))
        ctx, nxt, count = ctx[order], nxt[order], count[order]
        first = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]])
        total = np.add.reduceat(count, first)
        keep = (count[first] >= min_count) & (count[first] >= min_share * total)
        out[f"keys_{n}"] = ctx[first][keep]
        out[f"next_{n}"] = nxt[first][keep].astype(np.int32)
    return out


def save_table(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **arrays)


class NgramTable:
    """A loaded table: ``draft(tokens, k)`` chains its most frequent successors."""

    def __init__(self, arrays, min_n: int = 2) -> None:
        if int(arrays["format"]) != FORMAT:
            raise ConfigError(f"n-gram table format {int(arrays['format'])}, this code reads {FORMAT}")
        self.vocab = int(arrays["vocab"])
        self.min_n = min_n
        self._keys = [np.ascontiguousarray(arrays[f"keys_{n}"], np.int64) for n in range(1, MAX_N + 1)]
        self._next = [np.ascontiguousarray(arrays[f"next_{n}"], np.int32) for n in range(1, MAX_N + 1)]
        for keys in self._keys:
            if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
                raise ConfigError("n-gram table keys are not strictly increasing")

    def _get(self, n: int, key: int) -> int | None:
        keys = self._keys[n - 1]
        i = int(keys.searchsorted(key))
        return int(self._next[n - 1][i]) if i < len(keys) and int(keys[i]) == key else None

    @classmethod
    def load(cls, path: str | Path, min_n: int = 2) -> "NgramTable":
        """Raises ConfigError for a file that is not a table of this format."""
        try:
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files}
            return cls(arrays, min_n)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{path} is not an n-gram table of format {FORMAT}: {exc}") from exc

    def __len__(self) -> int:
        return sum(len(k) for k in self._keys)

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens, n): the table's successors chained from the longest suffix of ``tokens``
        it knows (n >= min_n: the order of the first draft's match); ([], 0) if it knows none."""
        v, out, first = self.vocab, [], 0
        ctx = list(tokens[-MAX_N:])
        while len(out) < k:
            for n in range(min(MAX_N, len(ctx)), self.min_n - 1, -1):
                key = 0
                for t in ctx[-n:]:
                    key = key * v + t
                hit = self._get(n, key)
                if hit is not None:
                    out.append(hit)
                    ctx.append(hit)
                    first = first or n
                    break
            else:
                break
        return out, first
