"""Host-side RoPE tables: one kernel body serves every rope variant mlx-lm builds.

Each variant reduces to per-pair inverse frequencies, a position scale and an
input scale (yarn's mscale, longrope's scale). They are computed the way
`mx.fast.rope` computes them, so the kernel's angles equal the reference's.
Variants whose frequencies depend on the offset (dynamic NTK) or another layout
(traditional, partial rotation) get None: the caller keeps the pure-MLX path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class RopeTables:
    inv_freq: mx.array  # (head_dim // 2,) float32
    position_scale: float
    input_scale: float


_CACHE: dict[int, tuple[nn.Module, RopeTables | None]] = {}


def _compute(rope: nn.Module, head_dim: int) -> RopeTables | None:
    half = head_dim // 2
    if getattr(rope, "traditional", False):
        return None
    dims = getattr(rope, "dims", getattr(rope, "dim", None))
    if dims != head_dim:
        return None
    if type(rope) is nn.RoPE:
        # mx.fast.rope's own formula for a base: exp(-i * log(base) / half), in float32.
        step = mx.array(math.log(rope.base) / half, dtype=mx.float32)
        inv_freq = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        return RopeTables(inv_freq, float(rope.scale), 1.0)
    freqs = getattr(rope, "_freqs", None)
    if freqs is None or freqs.shape != (half,):
        return None
    # YarnRoPE keeps its input scale in `mscale`, SuScaledRoPE in `_scale`.
    input_scale = float(getattr(rope, "mscale", getattr(rope, "_scale", 1.0)))
    inv_freq = mx.reciprocal(freqs.astype(mx.float32))
    return RopeTables(inv_freq, 1.0, input_scale)


def rope_tables(rope: nn.Module, head_dim: int) -> RopeTables | None:
    """The kernel's view of `rope` (computed once per rope module), or None if unsupported."""
    entry = _CACHE.get(id(rope))
    if entry is None or entry[0] is not rope:
        tables = _compute(rope, head_dim)
        if tables is not None:
            mx.eval(tables.inv_freq)
        # Holding the module keeps its id from being reused by another object.
        entry = _CACHE[id(rope)] = (rope, tables)
    return entry[1]
