"""The KV cache: keys and values of every layer for a batch of rows of different lengths."""

from __future__ import annotations

import torch
from torch import Tensor

from nowait.model.config import ModelConfig


class KVCache:
    """Keys and values of every layer for a batch of sequences of different lengths.

    Stored head-major, [batch, kv_heads, slots, head_dim], so the keys attention reads for a row
    and a head are one contiguous run: a batched decode step multiplies against slices of the
    cache in place instead of copying them. `lengths[b]` counts the valid slots of row b.
    Rolling back (speculative decoding) is lowering `lengths`; nothing is cleared.
    """

    def __init__(self, config: ModelConfig, batch: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch, config.num_kv_heads, max_tokens, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_tokens = max_tokens

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def truncate(self, lengths: Tensor) -> None:
        self.lengths = torch.minimum(self.lengths, lengths.to(self.lengths))

    def view(self, start: int, rows: int) -> KVCache:
        """Rows [start, start + rows) sharing this cache's storage (slices are views), so a
        forward through the view writes keys/values in place. A forward replaces its cache's
        `lengths` tensor rather than writing into it: copy the view's lengths back after it."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[start: start + rows] for k in self.keys]
        view.values = [v[start: start + rows] for v in self.values]
        view.lengths = self.lengths[start: start + rows]
        view.max_tokens = self.max_tokens
        return view

    def select(self, rows: Tensor) -> None:
        """Keep only the given batch rows (in that order), e.g. when sequences finish."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.lengths = self.lengths[rows]
