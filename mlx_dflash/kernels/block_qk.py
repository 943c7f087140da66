"""Block query/key preparation for one draft layer in one launch.

From the block's q_proj (B, L, n_heads * head_dim) and k_proj
(B, L, n_kv_heads * head_dim) outputs: q_norm / k_norm, RoPE at the block's
absolute positions, and the (B, heads, L, head_dim) layout attention reads.
It replaces the two norms, two RoPEs and two transposes of `Attention.__call__`.
"""

from __future__ import annotations

import mlx.core as mx

from . import _common, self_check
from .rope_tables import RopeTables

# One thread per (batch, head, position) row; query heads first, then key heads.
SOURCE = """
const uint B = uint(sizes[0]);
const uint L = uint(sizes[1]);
const uint HQ = uint(sizes[2]);
const uint HK = uint(sizes[3]);
const int offset = sizes[4];
const uint row = thread_position_in_grid.x;
if (row >= B * (HQ + HK) * L) {
  return;
}
const uint pos = row % L;
const uint h = (row / L) % (HQ + HK);
const uint b = row / (L * (HQ + HK));
const float position = (float(pos) + float(offset)) * params[2];
if (h < HQ) {
  dflash_norm_rope_row<D>(
      q + (size_t(b * L + pos) * HQ + h) * D, q_norm_weight, inv_freq, params[0], position, params[3],
      q_out + (size_t(b * HQ + h) * L + pos) * D);
} else {
  const uint hk = h - HQ;
  dflash_norm_rope_row<D>(
      k + (size_t(b * L + pos) * HK + hk) * D, k_norm_weight, inv_freq, params[1], position, params[3],
      k_out + (size_t(b * HK + hk) * L + pos) * D);
}
"""

SPEC = _common.KernelSpec(
    name="dflash_block_qk",
    input_names=("q", "k", "q_norm_weight", "k_norm_weight", "inv_freq", "params", "sizes"),
    output_names=("q_out", "k_out"),
    source=SOURCE,
)


def launch_args(
    *,
    q: mx.array,
    k: mx.array,
    q_norm_weight: mx.array,
    k_norm_weight: mx.array,
    q_eps: float,
    k_eps: float,
    tables: RopeTables,
    offset: int,
    num_heads: int,
    num_kv_heads: int,
) -> dict:
    """The keyword arguments of one kernel call (what the host emulation replays)."""
    B, L, _ = q.shape
    head_dim = q_norm_weight.shape[0]
    params = mx.array([q_eps, k_eps, tables.position_scale, tables.input_scale], dtype=mx.float32)
    sizes = mx.array([B, L, num_heads, num_kv_heads, offset], dtype=mx.int32)
    return dict(
        inputs=[q, k, q_norm_weight, k_norm_weight, tables.inv_freq, params, sizes],
        template=[("T", q.dtype), ("D", head_dim)],
        output_shapes=[(B, num_heads, L, head_dim), (B, num_kv_heads, L, head_dim)],
        output_dtypes=[q.dtype, k.dtype],
        **_common.grid_for(B * (num_heads + num_kv_heads) * L),
    )


def block_qk_reference(
    *,
    q: mx.array,
    k: mx.array,
    q_norm_weight: mx.array,
    k_norm_weight: mx.array,
    q_eps: float,
    k_eps: float,
    tables: RopeTables,
    offset: int,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[mx.array, mx.array]:
    """Pure-MLX twin of the kernel: what it must write, computed the same way (float32 inside)."""
    B, L, _ = q.shape
    positions = mx.arange(L, dtype=mx.float32) + offset
    q_rows = q.reshape(B, L, num_heads, -1).transpose(0, 2, 1, 3)
    k_rows = k.reshape(B, L, num_kv_heads, -1).transpose(0, 2, 1, 3)
    return (_common.norm_rope_rows(q_rows, q_norm_weight, q_eps, tables, positions, q.dtype),
            _common.norm_rope_rows(k_rows, k_norm_weight, k_eps, tables, positions, k.dtype))


def _launch(backend: str, **args) -> tuple[mx.array, mx.array]:
    q_out, k_out = _common.compiled(SPEC, backend)(**launch_args(**args))
    return q_out, k_out


def trial(backend: str, dtype: mx.Dtype, tables: RopeTables, head_dim: int):
    """Kernel and reference on a small input of this class (2 query heads, 1 key head, 4 positions)."""
    args = dict(
        q=self_check.small_normal((1, 4, 2 * head_dim), dtype, seed=2, scale=2.0),
        k=self_check.small_normal((1, 4, head_dim), dtype, seed=3, scale=2.0),
        q_norm_weight=self_check.small_normal((head_dim,), dtype, seed=4, scale=0.2, shift=1.0),
        k_norm_weight=self_check.small_normal((head_dim,), dtype, seed=5, scale=0.2, shift=1.0),
        q_eps=1e-6, k_eps=1e-5, tables=tables, offset=7, num_heads=2, num_kv_heads=1,
    )
    return list(_launch(backend, **args)), list(block_qk_reference(**args))


def prepare_block_qk(
    *,
    q: mx.array,
    k: mx.array,
    q_norm_weight: mx.array,
    k_norm_weight: mx.array,
    q_eps: float,
    k_eps: float,
    tables: RopeTables,
    offset: int,
    num_heads: int,
    num_kv_heads: int,
    backend: str = "metal",
) -> tuple[mx.array, mx.array]:
    """Normed, rotated block queries (B, n_heads, L, D) and keys (B, n_kv_heads, L, D); from the
    pure-MLX twin where this kernel failed its self-check."""
    args = dict(q=q, k=k, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, q_eps=q_eps, k_eps=k_eps,
                tables=tables, offset=offset, num_heads=num_heads, num_kv_heads=num_kv_heads)
    head_dim = q_norm_weight.shape[0]
    if self_check.usable(SPEC.name, backend, q.dtype, head_dim, lambda: trial(backend, q.dtype, tables, head_dim)):
        return _launch(backend, **args)
    return block_qk_reference(**args)
