"""The draft's own KV cache of the context rows it has folded."""

from __future__ import annotations

import numpy as np


class DraftCache:
    """The draft's keys and values of the context rows folded so far, positions 0..rows-1,
    per layer. Slots past `rows` are scratch for the block being drafted."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 256) -> None:
        self.rows = 0
        self._shape = (kv_heads, head_dim)
        self.keys = [np.empty((capacity, kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self.values = [np.empty((capacity, kv_heads, head_dim), np.float32) for _ in range(num_layers)]

    def reserve(self, total: int) -> None:
        """Make room for `total` positions, keeping the folded rows."""
        capacity = self.keys[0].shape[0]
        if total <= capacity:
            return
        capacity = max(total, 2 * capacity)
        for planes in (self.keys, self.values):
            for i, old in enumerate(planes):
                new = np.empty((capacity, *self._shape), np.float32)
                new[: self.rows] = old[: self.rows]
                planes[i] = new

    def clear(self) -> None:
        self.rows = 0

