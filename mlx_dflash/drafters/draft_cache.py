"""The drafter's context K/V cache: written once, never concatenated.

Per draft layer one preallocated buffer (B, kv_heads, capacity, head_dim) for
keys and one for values. Committed context K/V (already normed and rotated at
their absolute positions) are written once at the end of the stored span; each
cycle the block's transient K/V are written right after it, in place, and the
span [window start, stored + block) is attended. Capacity grows geometrically,
so the whole context is copied only O(log n) times over a generation. With a
window, the buffer keeps at most `window` committed positions plus slack, and
compacts (copies the last `window` positions to the front) when the slack is
used up: memory stays bounded and the copy is amortised O(1) per token.
"""

from __future__ import annotations

import mlx.core as mx

MIN_CAPACITY = 256


class DraftContextCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_block_size: int,
        dtype: mx.Dtype = mx.float32,
        window: int | None = None,
        layer_windows: list[int | None] | None = None,
        batch_size: int = 1,
    ):
        if window is not None and window < 1:
            raise ValueError(f"draft window must be a positive number of tokens, got {window}")
        self.num_layers = num_layers
        self.shape_prefix = (batch_size, num_kv_heads)
        self.head_dim = head_dim
        self.max_block_size = max_block_size
        self.dtype = dtype
        self.window = window
        # Sliding-attention draft layers see only the last `w` context positions.
        self.layer_windows = list(layer_windows) if layer_windows else [None] * num_layers
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.stored = 0  # committed positions held in the buffers
        self.dropped = 0  # committed positions compacted away (window mode only)
        self.capacity = 0
        self.growths = 0  # buffer reallocations (growth or compaction), for tests/benchmarks

    @property
    def offset(self) -> int:
        """Absolute position one past the last committed context position."""
        return self.dropped + self.stored

    def attend_start(self, layer: int = 0) -> int:
        """Buffer slot of the first context position a block attends to in `layer`."""
        windows = [w for w in (self.window, self.layer_windows[layer]) if w is not None]
        return max(0, self.stored - min(windows)) if windows else 0

    def _reallocate(self, capacity: int, keep_from: int) -> None:
        shape = (*self.shape_prefix, capacity, self.head_dim)
        kept = self.stored - keep_from
        for store in (self.keys, self.values):
            for i in range(self.num_layers):
                fresh = mx.zeros(shape, dtype=self.dtype)
                if store and kept > 0:
                    fresh[..., :kept, :] = store[i][..., keep_from : self.stored, :]
                if len(store) < self.num_layers:
                    store.append(fresh)
                else:
                    store[i] = fresh
        self.dropped += keep_from
        self.stored = kept
        self.capacity = capacity
        self.growths += 1

    def _reserve(self, num_new: int) -> None:
        needed = self.stored + num_new + self.max_block_size
        if needed <= self.capacity:
            return
        if self.window is not None:
            # Keep only what the window will still see after this append.
            keep_from = max(0, self.stored + num_new - self.window)
            capacity = max(2 * self.window + self.max_block_size, needed - keep_from)
            self._reallocate(capacity, keep_from)
            return
        self._reallocate(max(needed, 2 * self.capacity, MIN_CAPACITY), 0)

    def append(self, keys: list[mx.array], values: list[mx.array]) -> None:
        """Write newly committed context K/V, one (B, kv_heads, n, head_dim) pair per layer."""
        n = keys[0].shape[2]
        if n == 0:
            return
        if self.window is not None and n >= self.window:
            # Everything before the last `window` new positions is out of sight for good.
            skip = n - self.window
            keys = [k[..., skip:, :] for k in keys]
            values = [v[..., skip:, :] for v in values]
            self.dropped += self.stored + skip
            self.stored = 0
            n = self.window
        self._reserve(n)
        start = self.stored
        for i in range(self.num_layers):
            self.keys[i][..., start : start + n, :] = keys[i].astype(self.dtype)
            self.values[i][..., start : start + n, :] = values[i].astype(self.dtype)
        self.stored += n

    def attend_span(
        self, layer: int, block_keys: mx.array, block_values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write the block's transient K/V after the context and return the attended span."""
        n = block_keys.shape[2]
        if n > self.max_block_size:
            raise ValueError(f"block of {n} exceeds the cache's max block size {self.max_block_size}")
        if self.capacity == 0:
            self._reserve(0)
        end = self.stored + n
        self.keys[layer][..., self.stored : end, :] = block_keys.astype(self.dtype)
        self.values[layer][..., self.stored : end, :] = block_values.astype(self.dtype)
        start = self.attend_start(layer)
        return self.keys[layer][..., start:end, :], self.values[layer][..., start:end, :]

    def span_mask(self, layer: int, block: int) -> None:
        """Every block position sees the whole span (a batch of contexts of different lengths masks some)."""
        return None

    def trim(self, n: int) -> int:
        """Forget the last `n` committed positions (e.g. a reply dropped in chat)."""
        if n >= self.offset:
            self.stored = self.dropped = 0
            return n
        if n > self.stored:
            raise ValueError(
                f"cannot trim {n} positions: the window keeps only the last {self.stored}"
            )
        self.stored -= n
        return n

    def state_arrays(self) -> list[mx.array]:
        return self.keys + self.values
