"""The KV cache: allocated once per engine, one slot per running sequence, fixed capacity.

Arrays are numpy float32 [slots, KV, capacity, hd] per layer (BNSH, the layout ONNX Runtime's
GroupQueryAttention reads and appends to in place). Backends read and write them where they
lie: a decode step writes only its new rows. Slots are handed out lowest first, so sequences
admitted together hold consecutive slots and a batch over them is one contiguous block.
"""
from __future__ import annotations

import heapq

import numpy as np

from edge.core.errors import SmartExitError


class KVCache:
    """``allocate`` False: slots only, no host arrays (a backend that keeps its cache on a device)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, slots: int, capacity: int,
                 allocate: bool = True) -> None:
        self.shape = (slots, num_kv_heads, capacity, head_dim)  # of each layer's keys and values
        self.num_layers = num_layers
        self.keys = [np.zeros(self.shape, np.float32) for _ in range(num_layers)] if allocate else []
        self.values = [np.zeros(self.shape, np.float32) for _ in range(num_layers)] if allocate else []
        self.slots, self.capacity = slots, capacity
        self._free = list(range(slots))  # a heap: lowest slot first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise SmartExitError("KV cache is full: no free sequence slot")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise SmartExitError(f"cache slot {slot} is not in use")
        heapq.heappush(self._free, slot)


def contiguous_start(slots: np.ndarray) -> int | None:
    """s0 if ``slots`` is s0, s0+1, ..., s0+B-1 (the batch is one block of the cache), else None."""
    s0 = int(slots[0])
    if len(slots) == 1 or (int(slots[-1]) - s0 == len(slots) - 1 and bool(np.all(np.diff(slots) == 1))):
        return s0
    return None
