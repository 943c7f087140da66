"""Context K/V injection for ALL draft layers in one launch.

Takes the batched context K/V projection (B, n, layers, 2, kv_heads, head_dim),
applies each layer's k_norm and RoPE at the absolute positions to K, casts K and
V to the cache dtype, and writes both in the per-layer cache layout
(layers, B, kv_heads, n, head_dim). It replaces, per cycle, the norm, weight,
RoPE and cast launches and the transposes of `inject_context_kv_reference`.
"""

from __future__ import annotations

import mlx.core as mx

from . import _common, self_check
from .rope_tables import RopeTables

# One thread per (layer, batch, kv head, position) row, numbered in output order.
SOURCE = """
const uint B = uint(sizes[0]);
const uint n = uint(sizes[1]);
const uint L = uint(sizes[2]);
const uint H = uint(sizes[3]);
const int offset = sizes[4];
const uint row = thread_position_in_grid.x;
if (row >= L * B * H * n) {
  return;
}
const uint pos = row % n;
const uint h = (row / n) % H;
const uint b = (row / (n * H)) % B;
const uint layer = row / (n * H * B);
const size_t src = ((size_t(b * n + pos) * L + layer) * 2 * H + h) * D;
const size_t dst = size_t(row) * D;
dflash_norm_rope_row<D>(
    kv + src, k_norm_weight + layer * D, inv_freq, params[0],
    (float(pos) + float(offset)) * params[1], params[2], keys + dst);
for (int i = 0; i < D; ++i) {
  values[dst + i] = static_cast<T>(static_cast<float>(kv[src + H * D + i]));
}
"""

SPEC = _common.KernelSpec(
    name="dflash_context_kv",
    input_names=("kv", "k_norm_weight", "inv_freq", "params", "sizes"),
    output_names=("keys", "values"),
    source=SOURCE,
)


def launch_args(
    *, kv: mx.array, k_norm_weight: mx.array, eps: float, tables: RopeTables, offset: int, dtype: mx.Dtype
) -> dict:
    """The keyword arguments of one kernel call (what the host emulation replays)."""
    B, n, num_layers, _, num_kv_heads, head_dim = kv.shape
    params = mx.array([eps, tables.position_scale, tables.input_scale], dtype=mx.float32)
    sizes = mx.array([B, n, num_layers, num_kv_heads, offset], dtype=mx.int32)
    shape = (num_layers, B, num_kv_heads, n, head_dim)
    return dict(
        inputs=[kv, k_norm_weight, tables.inv_freq, params, sizes],
        template=[("T", dtype), ("D", head_dim)],
        output_shapes=[shape, shape],
        output_dtypes=[dtype, dtype],
        **_common.grid_for(num_layers * B * num_kv_heads * n),
    )


def context_kv_reference(
    *, kv: mx.array, k_norm_weight: mx.array, eps: float, tables: RopeTables, offset: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """Pure-MLX twin of the kernel: what it must write, computed the same way (float32 inside)."""
    n = kv.shape[1]
    keys = kv[:, :, :, 0].transpose(2, 0, 3, 1, 4)  # (layers, B, kv_heads, n, head_dim)
    values = kv[:, :, :, 1].transpose(2, 0, 3, 1, 4)
    positions = mx.arange(n, dtype=mx.float32) + offset
    keys = _common.norm_rope_rows(keys, k_norm_weight[:, None, None, None, :], eps, tables, positions, dtype)
    return keys, values.astype(dtype)


def _launch(backend: str, **args) -> tuple[mx.array, mx.array]:
    keys, values = _common.compiled(SPEC, backend)(**launch_args(**args))
    return keys, values


def trial(backend: str, in_dtype: mx.Dtype, dtype: mx.Dtype, tables: RopeTables, head_dim: int):
    """Kernel and reference on a small input of this class (2 layers, 2 heads, 3 positions)."""
    args = dict(
        kv=self_check.small_normal((1, 3, 2, 2, 2, head_dim), in_dtype, seed=0, scale=2.0),
        k_norm_weight=self_check.small_normal((2, head_dim), in_dtype, seed=1, scale=0.2, shift=1.0),
        eps=1e-6, tables=tables, offset=7, dtype=dtype,
    )
    return list(_launch(backend, **args)), list(context_kv_reference(**args))


def inject_context_kv(
    *,
    kv: mx.array,
    k_norm_weight: mx.array,
    eps: float,
    tables: RopeTables,
    offset: int,
    dtype: mx.Dtype,
    backend: str = "metal",
) -> tuple[mx.array, mx.array]:
    """Kernel twin of `inject_context_kv_reference` (same arguments, rope given as tables);
    the pure-MLX twin where this kernel failed its self-check."""
    args = dict(kv=kv, k_norm_weight=k_norm_weight, eps=eps, tables=tables, offset=offset, dtype=dtype)
    head_dim = kv.shape[-1]
    if self_check.usable(SPEC.name, backend, dtype, head_dim,
                         lambda: trial(backend, kv.dtype, dtype, tables, head_dim)):
        return _launch(backend, **args)
    return context_kv_reference(**args)
