"""The drafter's context K/V for a batch of sequences with different context lengths.

The batched twin of `DraftContextCache` (one sequence): per draft layer one buffer
(B, kv_heads, capacity, head_dim) for keys and one for values, row i's committed context
at slots 0..length_i - 1. `write` puts a verify cycle's injected K/V at each row's end and
commits a different number of them per row (the rest is overwritten later). A drafting
block's transient K/V go after the longest row's context, at the same slots for every row;
`span_mask` hides each shorter row's unused slots, so every row attends to exactly its own
context and its block, as it would alone. Window modes are not batched (`from_caches`
refuses them).

As for the target's ragged cache, joins, leaves and growth copy one layer at a time, and a
leave shrinks the buffers to what the remaining rows need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from ..drafters.draft_cache import MIN_CAPACITY, DraftContextCache
from ..errors import DFlashError


class RaggedDraftCache:
    step = 256

    def __init__(self, keys: list[mx.array], values: list[mx.array], lengths: Sequence[int], *,
                 max_block_size: int, dtype: mx.Dtype):
        self.keys, self.values = keys, values
        self.lengths = [int(n) for n in lengths]
        self.max_block_size = max_block_size
        self.dtype = dtype

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def offset(self) -> mx.array:
        """Each row's context length (B,): the position of its pending token."""
        return mx.array(self.lengths, dtype=mx.int32)

    @classmethod
    def capacity_for(cls, context: int, max_block_size: int) -> int:
        """Slots for `context` positions and a drafting block after them, in whole steps."""
        return max(-(-(context + max_block_size) // cls.step), 1) * cls.step

    def reserve(self, end: int) -> None:
        """Grow every layer's buffers to `end` slots, one layer at a time (each evaluated), so a
        growth holds one layer's copy in flight; call it before the cycle that needs the room."""
        grow = self._growth(end)
        if grow:
            self._each_layer(lambda buffer: self._longer(buffer, grow))

    def _reserve(self, end: int) -> None:
        """Room inside a cycle (lazily, every layer at once): `reserve` beforehand makes this a no-op."""
        grow = self._growth(end)
        for store in (self.keys, self.values) if grow else ():
            store[:] = [self._longer(buffer, grow) for buffer in store]

    def _growth(self, end: int) -> int:
        """Slots to add (whole steps) so that `end` fit; 0 when they do."""
        return max(-(-(end - self.capacity) // self.step) * self.step, 0)

    def _longer(self, buffer: mx.array, grow: int) -> mx.array:
        B, H, _, D = buffer.shape
        return mx.concatenate([buffer, mx.zeros((B, H, grow, D), self.dtype)], axis=2)

    def _each_layer(self, change: Callable[[mx.array], mx.array]) -> None:
        """Replace every buffer by `change(buffer)`, evaluating each layer before the next."""
        for i in range(self.num_layers):
            self.keys[i], self.values[i] = change(self.keys[i]), change(self.values[i])
            mx.eval(self.keys[i], self.values[i])

    def write(self, keys: Sequence[mx.array], values: Sequence[mx.array], counts: Sequence[int]) -> None:
        """Write n positions per row at its end (one (B, kv_heads, n, head_dim) pair per layer), and
        commit the first counts[i] of row i's."""
        n = keys[0].shape[2]
        if len(counts) != len(self.lengths) or any(c < 0 or c > n for c in counts):
            raise DFlashError(f"RaggedDraftCache.write: counts {list(counts)} must be within 0..{n}, one per row")
        self._reserve(max(self.lengths) + n + self.max_block_size)
        slots = (self.offset[:, None] + mx.arange(n, dtype=mx.int32))[:, None, :, None]  # (B, 1, n, 1)
        for i in range(self.num_layers):
            self.keys[i] = mx.put_along_axis(self.keys[i], slots, keys[i].astype(self.dtype), axis=2)
            self.values[i] = mx.put_along_axis(self.values[i], slots, values[i].astype(self.dtype), axis=2)
        self.lengths = [length + c for length, c in zip(self.lengths, counts, strict=True)]

    def attend_span(self, layer: int, block_keys: mx.array, block_values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the block's K/V after the longest context (the same slots in every row) and return
        the span every row attends to; `span_mask` says which of it is each row's."""
        n = block_keys.shape[2]
        start = max(self.lengths)
        self._reserve(start + n)
        end = start + n
        self.keys[layer][..., start:end, :] = block_keys.astype(self.dtype)
        self.values[layer][..., start:end, :] = block_values.astype(self.dtype)
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def span_mask(self, layer: int, block: int) -> mx.array:
        """(B, 1, block, span) boolean: row i sees its own context slots and the whole block."""
        start = max(self.lengths)
        slots = mx.arange(start + block, dtype=mx.int32)
        visible = (slots[None, :] < self.offset[:, None]) | (slots[None, :] >= start)  # (B, span)
        return mx.broadcast_to(visible[:, None, None, :], (len(self.lengths), 1, block, start + block))

    # --- rows in and out -------------------------------------------------------------------

    @classmethod
    def from_caches(cls, caches: Sequence[DraftContextCache]) -> RaggedDraftCache:
        """One row per single-sequence draft cache (no window; holding every position it was given)."""
        first = caches[0]
        for i, c in enumerate(caches):
            if c.window is not None or any(w is not None for w in c.layer_windows) or c.dropped:
                raise DFlashError(f"RaggedDraftCache.from_caches: row {i} has a draft window; windows are not batched")
            if c.shape_prefix[0] != 1:
                raise DFlashError(f"RaggedDraftCache.from_caches: row {i} holds a batch of {c.shape_prefix[0]}")
        lengths = [c.stored for c in caches]
        capacity = cls.capacity_for(max(lengths), first.max_block_size)
        shape = (first.shape_prefix[1], 0, first.head_dim)

        def stacked(store: str, layer: int) -> mx.array:
            rows = []
            for c, n in zip(caches, lengths, strict=True):
                held = getattr(c, store)[layer][..., :n, :] if n else mx.zeros((1, *shape), first.dtype)
                rows.append(mx.pad(held, [(0, 0), (0, 0), (0, capacity - n), (0, 0)]))
            return mx.concatenate(rows)

        keys = [stacked("keys", i) for i in range(first.num_layers)]
        values = [stacked("values", i) for i in range(first.num_layers)]
        return cls(keys, values, lengths, max_block_size=first.max_block_size, dtype=first.dtype)

    def row(self, i: int) -> DraftContextCache:
        """Row i's context as a single-sequence draft cache (a copy), to go on alone."""
        B, H, _, D = self.keys[0].shape
        n = self.lengths[i]
        cache = DraftContextCache(self.num_layers, H, D, max_block_size=self.max_block_size, dtype=self.dtype)
        capacity = max(n + self.max_block_size, MIN_CAPACITY)
        pad = [(0, 0), (0, 0), (0, capacity - n), (0, 0)]
        cache.keys = [mx.pad(k[i : i + 1, :, :n], pad) for k in self.keys]
        cache.values = [mx.pad(v[i : i + 1, :, :n], pad) for v in self.values]
        cache.stored, cache.capacity = n, capacity
        return cache

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order, in buffers no longer than they need."""
        index = mx.array(list(rows), dtype=mx.int32)
        self.lengths = [self.lengths[i] for i in rows]
        capacity = min(self.capacity_for(max(self.lengths, default=0), self.max_block_size), self.capacity)
        # A gather of the slice: new buffers of the kept size, not views of the old ones.
        self._each_layer(lambda b: mx.take(b[..., :capacity, :], index, axis=0))

    def extend(self, other: RaggedDraftCache) -> None:
        """Append `other`'s rows after this cache's."""
        capacity = max(self.capacity, other.capacity)

        def padded(buffer: mx.array) -> mx.array:
            if buffer.shape[2] == capacity:  # a pad of nothing would still copy
                return buffer
            return mx.pad(buffer, [(0, 0), (0, 0), (0, capacity - buffer.shape[2]), (0, 0)])

        for i, (k, v) in enumerate(zip(other.keys, other.values, strict=True)):  # one layer in flight at a time
            self.keys[i] = mx.concatenate([padded(self.keys[i]), padded(k)])
            self.values[i] = mx.concatenate([padded(self.values[i]), padded(v)])
            mx.eval(self.keys[i], self.values[i])
        self.lengths = self.lengths + other.lengths

    def state_arrays(self) -> list[mx.array]:
        return self.keys + self.values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state_arrays())
