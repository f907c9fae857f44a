"""Timing wrappers that attribute engine time to backend calls and the exit rule."""
from __future__ import annotations

import time
from collections import defaultdict

from edge.runtime.backend import Backend


class ProfiledBackend:
    """Wraps a backend; ``seconds`` holds wall time per public call kind (segment_i, the decode fast path,
    the graph of every layer, kvfill)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.seconds: dict[str, float] = defaultdict(float)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _timed(self, kind, fn, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[kind] += time.perf_counter() - t
        return out

    def segment(self, i, *args, **kwargs):
        return self._timed(f"segment_{i}", self.inner.segment, i, *args, **kwargs)

    def decode_until_exit(self, *args, **kwargs):
        return self._timed("decode_until_exit", self.inner.decode_until_exit, *args, **kwargs)

    def full(self, *args, **kwargs):
        return self._timed("full", self.inner.full, *args, **kwargs)

    def head(self, i, *args, **kwargs):
        return self._timed(f"head_{i}", self.inner.head, i, *args, **kwargs)

    def kvfill(self, i, *args, **kwargs):
        return self._timed("kvfill", self.inner.kvfill, i, *args, **kwargs)


class ProfiledRule:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name):  # linear(), decide_gated(): the rule's own
        return getattr(self.inner, name)

    def decide(self, layer, stats, tokens, hidden):
        t = time.perf_counter()
        out = self.inner.decide(layer, stats, tokens, hidden)
        self.seconds += time.perf_counter() - t
        return out
