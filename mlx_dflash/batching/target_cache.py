"""A K/V cache for a batch of sequences of different lengths, with per-row rollback.

Continuous batching verifies one block for every live sequence in a single
target forward, but the sequences have different lengths and each keeps a different
number of the block's positions. mlx-lm's `BatchKVCache` left-pads rows to a common end
and trims all rows alike, so it cannot roll rows back by different amounts.
`RaggedKVCache` keeps each row right-ragged instead: row i's committed keys are at
positions 0..length_i - 1 of its buffer, a forward writes its L new positions at
length_i..length_i + L - 1, and `advance` / `set_lengths` then commit any prefix of them
per row (what is not committed is simply overwritten by the next forward).

mlx-lm's attention classes (llama/mistral, qwen2, qwen3, qwen3_moe, phi3, gemma2, ...)
run unmodified on it: they read only `cache.offset` (passed to RoPE, where an array of B
offsets gives each row its own positions), call `cache.update_and_fetch(k, v)`, and get
their mask from `create_attention_mask(h, cache)`, which calls `cache.make_mask`. The
mask (B, 1, N, S) lets row i's query j see key p iff p < length_i + j + 1, so the zeros
or stale keys past a row's end never count.

Memory: a join, a leave or a growth copies one layer at a time (each is evaluated before the
next), so what is in flight beside the batch is one layer's buffers; a leave shrinks the
buffers to what the remaining rows hold, so a long row that left costs nothing after it
(`batch.BatchFootprint` budgets exactly this).

Not covered: quantized K/V (mlx-lm switches to quantized attention on a cache with
`bits`; `from_caches` refuses `QuantizedKVCache` rows), sliding-window layers (rotating
caches; `make_mask` refuses a window), recurrent state (`ArraysCache`), and RoPE variants
that use the offset as a Python int (`DynamicNTKScalingRoPE`, rope_scaling "dynamic").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError

Counts = int | Sequence[int] | mx.array


def _as_list(values: Counts, batch: int) -> list[int]:
    """Per-row integers from an int (every row), a sequence or an mx.array of shape (B,)."""
    if isinstance(values, int):
        return [values] * batch
    out = values.tolist() if isinstance(values, mx.array) else [int(v) for v in values]
    if len(out) != batch:
        raise DFlashError(f"expected {batch} per-row values, got {len(out)}")
    return out


class RaggedKVCache:
    """One attention layer's K/V for B rows of different committed lengths.

    `keys` / `values` are (B, n_kv_heads, capacity, head_dim) buffers grown in steps of
    `step` positions, as mlx-lm's KVCache grows. `lengths` (host ints) are the committed
    lengths; `offset` is the same as an int32 array of shape (B,), for RoPE.
    """

    step = 256

    def __init__(self, lengths: Sequence[int] = (), keys: mx.array | None = None, values: mx.array | None = None):
        self.keys = keys
        self.values = values
        self._lengths = [int(n) for n in lengths]
        self._offset: mx.array | None = None
        self._written = 0  # positions the last forward wrote past each row's length, not yet committed

    # --- what mlx-lm's attention reads ---------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    @property
    def offset(self) -> mx.array:
        """Each row's committed length (B,): the position of its first new token."""
        if self._offset is None:
            self._offset = mx.array(self._lengths, dtype=mx.int32)
        return self._offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write row i's L new positions at length_i; return keys/values up to max(length) + L.

        Lengths do not move: the caller commits with `advance` or `set_lengths`, which must
        come before the next forward (a second write would land on the same positions).
        """
        B, H, L, _ = keys.shape
        if B != self.batch_size:
            raise DFlashError(f"RaggedKVCache holds {self.batch_size} rows, the forward has {B}")
        if self._written:
            raise DFlashError("RaggedKVCache: the last forward's positions were not committed "
                              "(call advance or set_lengths between forwards)")
        end = max(self._lengths) + L
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(end, B, H, keys.shape[3], values.shape[3], keys.dtype)
        positions = (self.offset[:, None] + mx.arange(L, dtype=mx.int32))[:, None, :, None]  # (B, 1, L, 1)
        self.keys = mx.put_along_axis(self.keys, positions, keys, axis=2)
        self.values = mx.put_along_axis(self.values, positions, values, axis=2)
        self._written = L
        return self.keys[..., :end, :], self.values[..., :end, :]

    @classmethod
    def capacity_for(cls, positions: int) -> int:
        """The buffer length that holds `positions`: whole steps, at least one."""
        return max(-(-positions // cls.step), 1) * cls.step

    def reserve(self, end: int) -> None:
        """Grow the buffers (evaluated) to hold `end` positions per row before a forward writes
        there, so the forward does not copy every layer at once. A cache never written to waits
        for its first write, which knows the shapes."""
        if self.keys is not None and end > self.keys.shape[2]:
            B, H, _, k_dim = self.keys.shape
            self._grow(end, B, H, k_dim, self.values.shape[3], self.keys.dtype)
            mx.eval(self.keys, self.values)

    def _grow(self, end: int, B: int, H: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        capacity = self.capacity_for(end)
        have = 0 if self.keys is None else self.keys.shape[2]
        new_k = mx.zeros((B, H, capacity - have, k_dim), dtype)
        new_v = mx.zeros((B, H, capacity - have, v_dim), dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **kwargs: Any) -> mx.array:
        """Boolean (B, 1, N, max(length) + N): row i's query j sees key p iff p < length_i + j + 1.

        Always an array (never "causal" or None): rows end at different positions.
        """
        if window_size is not None:
            raise DFlashError("RaggedKVCache does not support sliding-window attention layers")
        limit = self.offset[:, None] + mx.arange(1, N + 1, dtype=mx.int32)  # (B, N): length_i + j + 1
        keys = mx.arange(max(self._lengths) + N, dtype=mx.int32)
        return (keys[None, None, :] < limit[:, :, None])[:, None]

    # --- committing and rolling back -----------------------------------------------------

    def advance(self, counts: Counts) -> None:
        """Commit the first counts[i] of the positions the last forward wrote for row i."""
        counts = _as_list(counts, self.batch_size)
        if any(c < 0 or c > self._written for c in counts):
            raise DFlashError(f"advance{tuple(counts)}: each count must be within 0..{self._written} "
                              "(the positions the last forward wrote)")
        self._commit([n + c for n, c in zip(self._lengths, counts, strict=True)])

    def set_lengths(self, lengths: Counts) -> None:
        """Set each row's committed length (a rollback into its history, or a commit of written positions)."""
        lengths = _as_list(lengths, self.batch_size)
        if any(n < 0 or n > old + self._written for n, old in zip(lengths, self._lengths, strict=True)):
            raise DFlashError(f"set_lengths{tuple(lengths)}: a row cannot hold positions it never wrote")
        self._commit(lengths)

    def _commit(self, lengths: list[int]) -> None:
        self._lengths = lengths
        self._offset = None
        self._written = 0

    # --- rows in and out -------------------------------------------------------------------

    @classmethod
    def from_caches(cls, caches: Sequence[KVCache | None]) -> RaggedKVCache:
        """One row per single-sequence mlx-lm KVCache (None or an empty cache: a length-0 row)."""
        for i, c in enumerate(caches):
            if c is not None and type(c) is not KVCache:
                raise DFlashError(f"RaggedKVCache.from_caches: row {i} holds a {type(c).__name__}; only plain "
                                  "mlx-lm KVCache rows (full attention, not quantized) can be batched")
            if c is not None and c.keys is not None and c.keys.shape[0] != 1:
                raise DFlashError(f"RaggedKVCache.from_caches: row {i} holds a batch of {c.keys.shape[0]}")
        full = [c for c in caches if c is not None and c.keys is not None]
        lengths = [0 if c is None or c.keys is None else c.offset for c in caches]
        if not full:
            return cls(lengths)
        _, H, _, k_dim = full[0].keys.shape
        v_dim, dtype = full[0].values.shape[3], full[0].keys.dtype
        capacity = cls.capacity_for(max(lengths))

        def padded(c: KVCache | None, n: int, dim: int, values: bool) -> mx.array:
            held = (c.values if values else c.keys)[..., :n, :] if n else mx.zeros((1, H, 0, dim), dtype)
            return mx.pad(held, [(0, 0), (0, 0), (0, capacity - n), (0, 0)])

        keys = mx.concatenate([padded(c, n, k_dim, False) for c, n in zip(caches, lengths, strict=True)])
        values = mx.concatenate([padded(c, n, v_dim, True) for c, n in zip(caches, lengths, strict=True)])
        return cls(lengths, keys, values)

    def row(self, i: int) -> KVCache:
        """Row i's committed positions as a single-sequence mlx-lm KVCache (a copy)."""
        cache = KVCache()
        n = self._lengths[i]
        if self.keys is not None and n:
            cache.keys = mx.contiguous(self.keys[i : i + 1, :, :n])
            cache.values = mx.contiguous(self.values[i : i + 1, :, :n])
            cache.offset = n
        return cache

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order (sequences that left the batch are dropped), in buffers
        no longer than the kept rows need: the memory of a long row that left is given back."""
        if self._written:
            raise DFlashError("RaggedKVCache.filter: commit the last forward first")
        lengths = [self._lengths[i] for i in rows]
        if self.keys is not None:
            index = mx.array(list(rows), dtype=mx.int32)
            capacity = min(self.capacity_for(max(lengths, default=0)), self.keys.shape[2])
            # A gather of the slice: new buffers of the kept size, not views of the old ones.
            self.keys = mx.take(self.keys[..., :capacity, :], index, axis=0)
            self.values = mx.take(self.values[..., :capacity, :], index, axis=0)
            mx.eval(self.keys, self.values)
        self._commit(lengths)

    def extend(self, other: RaggedKVCache) -> None:
        """Append `other`'s rows after this cache's (sequences joining the batch)."""
        if self._written or other._written:
            raise DFlashError("RaggedKVCache.extend: commit the last forward first")
        held = [c for c in (self, other) if c.keys is not None]
        if held:
            capacity = max(c.keys.shape[2] for c in held)
            k_like, v_like = held[0].keys, held[0].values

            def buffers(c: RaggedKVCache) -> tuple[mx.array, mx.array]:
                if c.keys is None:  # never written: all its rows are length 0
                    return (mx.zeros((c.batch_size, k_like.shape[1], capacity, k_like.shape[3]), k_like.dtype),
                            mx.zeros((c.batch_size, v_like.shape[1], capacity, v_like.shape[3]), v_like.dtype))
                if c.keys.shape[2] == capacity:  # a pad of nothing would still copy
                    return c.keys, c.values
                pad = [(0, 0), (0, 0), (0, capacity - c.keys.shape[2]), (0, 0)]
                return mx.pad(c.keys, pad), mx.pad(c.values, pad)

            (k1, v1), (k2, v2) = buffers(self), buffers(other)
            self.keys, self.values = mx.concatenate([k1, k2]), mx.concatenate([v1, v2])
            mx.eval(self.keys, self.values)
        self._commit(self._lengths + other._lengths)

    # --- what mlx-lm's utilities read --------------------------------------------------------

    @property
    def state(self) -> tuple[Any, ...]:
        """The buffers and lengths (what `mx.eval` needs; the buffers are None until the first write)."""
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, lengths = v
        self._commit([int(n) for n in lengths.tolist()])

    @property
    def meta_state(self) -> str:
        return ""

    @meta_state.setter
    def meta_state(self, v: str) -> None:
        pass

    def is_trimmable(self) -> bool:
        return False  # rollback is per row: set_lengths

    def size(self) -> int:
        return max(self._lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def batch_rows(rows: Sequence[Sequence[KVCache | None]]) -> list[RaggedKVCache]:
    """Per-layer ragged caches from per-sequence layer lists (rows[i][layer], e.g. `make_prompt_cache` each)."""
    return [RaggedKVCache.from_caches(layer) for layer in zip(*rows, strict=True)]


def unbatch_row(cache: Sequence[RaggedKVCache], i: int) -> list[KVCache]:
    """Sequence i's per-layer KVCaches, to continue it alone."""
    return [c.row(i) for c in cache]
