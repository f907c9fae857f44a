"""Preallocated KV cache: one slot per running sequence, fixed maximum length.

Arrays are numpy float32 [slots, KV, max_len, hd] per layer, shared by every
backend (the torch backend wraps them without copying).
"""
from __future__ import annotations

import numpy as np

from edge.errors import SmartExitError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, slots: int, max_len: int) -> None:
        shape = (slots, num_kv_heads, max_len, head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(num_layers)]
        self.slots, self.max_len = slots, max_len
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise SmartExitError("KV cache is full: no free sequence slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise SmartExitError(f"cache slot {slot} is not in use")
        self._free.append(slot)

    def gather(self, layer: int, slots: np.ndarray, past: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys / values [B, KV, past, hd] of ``slots`` (positions >= a slot's length are stale: mask them)."""
        return self.keys[layer][slots, :, :past], self.values[layer][slots, :, :past]

    def write(self, layer: int, slots: np.ndarray, positions: np.ndarray, rows: np.ndarray | None,
              k: np.ndarray, v: np.ndarray) -> None:
        """Store new keys / values k, v [B, KV, T, hd]: row r of batch b goes to position positions[b, r]
        for the (b, r) pairs selected by the boolean ``rows`` [B, T] (None: every pair)."""
        if rows is None and positions.shape[1] == 1:  # one new token per sequence: the decode step
            self.keys[layer][slots, :, positions[:, 0]] = k[:, :, 0]
            self.values[layer][slots, :, positions[:, 0]] = v[:, :, 0]
            return
        if rows is None:
            rows = np.ones(positions.shape, bool)
        b_idx, r_idx = np.nonzero(rows)
        self.keys[layer][slots[b_idx], :, positions[b_idx, r_idx]] = k[b_idx, :, r_idx]
        self.values[layer][slots[b_idx], :, positions[b_idx, r_idx]] = v[b_idx, :, r_idx]
