"""Corpus n-gram drafts: what the model itself, and the training text, most often wrote after the
sequence's last tokens.

Retrieval drafts (REST, He et al. 2024) propose continuations found in a datastore instead of in the
sequence itself. Here the datastore is a table built once from the training split (never the
calibration or test split), from two sources: the model's own greedy full-depth continuations of
training-split windows (what verification will accept: the table predicts the model, not the text),
and the training text itself where the model's continuations know no successor. For n = 1..the
table's order (up to ``MAX_N``), each n-gram that occurs at least ``min_count`` times maps to its
most frequent next token, kept where that token follows it in at least ``min_share`` of its
occurrences. A draft chains the table greedily from the sequence's longest known suffix
(n >= ``min_n``). Mode exact verifies the drafts (edge/runtime/speculative.py): a poor table costs
speed, never exactness.

Why the model's continuations (stop 49; docs/runtime.md): against the demo model's own greedy
continuations of 120 test-split prompts, drafts of up to 6 tokens from a table of 2,048 training
windows' continuations over the text's n-grams were accepted 1.93 tokens per decode position (a draft
at 86% of positions, 2.25 accepted per draft) against 0.57 for the text's table alone (44%, 1.32).

The table is a file of packed keys and their tokens (``.npz``) that the export writes into the exits
export's folder, built with the run's tokenizer (so it goes with the graphs it was exported beside);
:class:`NgramTable` keeps the sorted arrays (about 12 bytes an entry) and finds a key by binary
search. A key packs n + 1 tokens in an int64, so a large vocabulary gets a lower order
(:func:`order_for`): 4 for up to 6,208 tokens, 3 up to 55,108, 2 up to ~2 million.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from edge.core.errors import ConfigError

MAX_N = 4  # the longest n-gram a table may key (the engine sizes its acceptance counts by it)
TEXT_ORDER = 3  # the text's n-grams go to n = 3: its 4-grams (800k more in the demo) would outrank the model's 3-grams
FORMAT = 1
NGRAM_FILE = "ngram.npz"  # its name in an export folder (edge/runtime/graphs.py NGRAM_TABLE)


def _pack(windows: np.ndarray, vocab: int) -> np.ndarray:
    """[M, n] int64 token windows -> [M] int64 keys (base-``vocab`` digits)."""
    key = np.zeros(len(windows), np.int64)
    for j in range(windows.shape[1]):
        key = key * vocab + windows[:, j]
    return key


def order_for(vocab: int) -> int:
    """The longest n-gram (<= MAX_N) whose n + 1 tokens pack into an int64 key for ``vocab`` tokens.

    Raises:
        ConfigError: not even a 1-gram and its successor fit (a vocabulary over ~3 billion tokens).
    """
    n = MAX_N
    while n >= 1 and vocab ** (n + 1) >= 2 ** 63:
        n -= 1
    if n < 1:
        raise ConfigError(f"a vocabulary of {vocab} tokens is too large for n-gram keys packed in int64")
    return n


def build_table(sequences: Iterable[np.ndarray], vocab: int, min_count: int = 2, min_share: float = 0.5,
                order: int = MAX_N) -> dict[str, np.ndarray]:
    """The arrays of a table (``keys_<n>``, ``next_<n>``, sorted by key, n = 1..min(``order``,
    :func:`order_for` (vocab))) from token sequences (1-D int arrays of one document each)."""
    seqs = [np.asarray(s, np.int64) for s in sequences]
    out: dict[str, np.ndarray] = {"vocab": np.array(vocab), "format": np.array(FORMAT)}
    for n in range(1, min(order, order_for(vocab)) + 1):
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


def merge_tables(primary: dict[str, np.ndarray], fallback: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One table of two (:func:`build_table`'s arrays, the same vocabulary): every key of either, with
    ``primary``'s successor where both have the key; the order is the larger of the two.

    Raises:
        ConfigError: the tables' vocabularies differ.
    """
    if int(primary["vocab"]) != int(fallback["vocab"]):
        raise ConfigError(f"n-gram tables of vocabularies {int(primary['vocab'])} and {int(fallback['vocab'])} "
                          "cannot be merged")
    out: dict[str, np.ndarray] = {"vocab": np.array(int(primary["vocab"])), "format": np.array(FORMAT)}
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int32))
    for n in range(1, MAX_N + 1):
        parts = [(t[f"keys_{n}"], t[f"next_{n}"]) for t in (primary, fallback) if f"keys_{n}" in t]
        if not parts:
            break
        (pk, pn), (fk, fn) = parts[0], parts[1] if len(parts) > 1 else empty
        extra = ~np.isin(fk, pk)
        keys, nxt = np.concatenate([pk, fk[extra]]), np.concatenate([pn, fn[extra]]).astype(np.int32)
        order = np.argsort(keys, kind="stable")
        out[f"keys_{n}"], out[f"next_{n}"] = keys[order], nxt[order]
    return out


def training_windows(sequences: list[np.ndarray], count: int, length: int, follow: int, seed: int
                     ) -> list[list[int]]:
    """Up to ``count`` windows of ``length`` tokens from ``sequences`` (documents), each followed in its
    document by at least ``follow`` more tokens, none overlapping another's window or what follows it;
    drawn at random (``seed``) from all such windows of all documents."""
    step = length + follow
    found = [(i, s) for i, doc in enumerate(sequences) for s in range(0, len(doc) - step + 1, step)]
    rng = np.random.default_rng(seed)
    pick = rng.permutation(len(found))[:count]
    return [[int(t) for t in sequences[found[j][0]][found[j][1]:found[j][1] + length]] for j in sorted(pick)]


def checked_table(sha256: str | None, table: "NgramTable | None", where: str) -> "NgramTable | None":
    """The table an exit rule's context lookup falls back to: None where the rule names none (``sha256``
    None), else ``table`` (what ``where`` loaded) if it is that one.

    Raises:
        ConfigError: the rule was calibrated with a corpus table that ``where`` lacks or holds another of.
    """
    if sha256 is None:
        return None
    if table is None or table.sha256 != sha256:
        got = "none" if table is None else f"{(table.sha256 or 'an unsaved table')[:16]}..."
        raise ConfigError(f"the exit rule was calibrated with the corpus n-gram table {sha256[:16]}... (the export's "
                          f"ngram.npz), but {where} has {got}; serve the export the rule was calibrated on, or "
                          "re-run `smartexit calibrate`")
    return table


def save_table(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **arrays)


class NgramTable:
    """A loaded table: ``draft(tokens, k)`` chains its most frequent successors."""

    def __init__(self, arrays, min_n: int = 2) -> None:
        if int(arrays["format"]) != FORMAT:
            raise ConfigError(f"n-gram table format {int(arrays['format'])}, this code reads {FORMAT}")
        self.vocab = int(arrays["vocab"])
        self.min_n = min_n
        self.sha256: str | None = None  # the file's, when loaded from one (a rule's lookup names its table by it)
        # the table's order: its keys_<n> for n = 1.. (tables written before MAX_N was 4 stop at 3)
        self.order = next((n - 1 for n in range(1, MAX_N + 2) if f"keys_{n}" not in arrays), MAX_N)
        if self.order < 1:
            raise ConfigError("an n-gram table without keys_1")
        self._keys = [np.ascontiguousarray(arrays[f"keys_{n}"], np.int64) for n in range(1, self.order + 1)]
        self._next = [np.ascontiguousarray(arrays[f"next_{n}"], np.int32) for n in range(1, self.order + 1)]
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
        from edge.core.artifacts import sha256_file

        try:
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files}
            table = cls(arrays, min_n)
            table.sha256 = sha256_file(path)
            return table
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{path} is not an n-gram table of format {FORMAT}: {exc}") from exc

    def __len__(self) -> int:
        return sum(len(k) for k in self._keys)

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens, n): the table's successors chained from the longest suffix of ``tokens``
        it knows (n >= min_n: the order of the first draft's match); ([], 0) if it knows none."""
        v, out, first, order = self.vocab, [], 0, self.order
        ctx = list(tokens[-order:])
        while len(out) < k:
            for n in range(min(order, len(ctx)), self.min_n - 1, -1):
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
