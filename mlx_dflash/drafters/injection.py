"""Context K/V injection: the committed positions' features into every draft layer.

The context K/V of all draft layers depend only on the fused context features,
so one batched projection computes them for every layer at once; then each
layer's k_norm and the shared RoPE are applied and the results are written
into the draft cache. `inject_context_kv_reference` is the pure-MLX definition
that the Metal kernel (mlx_dflash.kernels.context_kv) must reproduce; the
injector uses the kernel where one is available.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .dflash import DFlashDraftModel
from .draft_cache import DraftContextCache

_STACKED = ("weight", "scales", "biases", "bias")


def inject_context_kv_reference(
    *,
    kv: mx.array,
    k_norm_weight: mx.array,
    eps: float,
    rope: nn.Module,
    offset: int | mx.array,
    dtype: mx.Dtype,
) -> tuple[mx.array, mx.array]:
    """Normalise and rotate a batched context K/V projection.

    kv: (B, n, layers, 2, kv_heads, head_dim), the K (index 0) and V (index 1)
        projections of n context positions for every draft layer.
    k_norm_weight: (layers, head_dim), each layer's k_norm weight.
    offset: absolute position of the first of the n positions (an int, or one per row (B,)).
    Returns keys, values of shape (layers, B, kv_heads, n, head_dim) in `dtype`,
    laid out as the per-layer caches store them.
    """
    B, n, num_layers, _, num_kv_heads, head_dim = kv.shape
    keys = kv[:, :, :, 0].transpose(2, 0, 3, 1, 4)  # (layers, B, kv_heads, n, head_dim)
    values = kv[:, :, :, 1].transpose(2, 0, 3, 1, 4)
    keys = mx.fast.rms_norm(keys, None, eps) * k_norm_weight[:, None, None, None, :]
    flat = keys.reshape(num_layers * B, num_kv_heads, n, head_dim)
    if isinstance(offset, mx.array):  # flat rows are layer-major: each layer repeats the batch's offsets
        offset = mx.tile(offset, (num_layers,))
    keys = rope(flat, offset=offset).reshape(num_layers, B, num_kv_heads, n, head_dim)
    return keys.astype(dtype), values.astype(dtype)


def _unfilled_like(proto: nn.Module) -> nn.Module:
    """A projection of `proto`'s kind and settings (bits, group size, mode) with no parameters yet.

    Built without running `__init__`: its random initialisation would draw from MLX's global
    generator, so building an injector would shift the draws of a seeded generation.
    """
    module = type(proto).__new__(type(proto))
    nn.Module.__init__(module)
    module.__dict__.update({k: v for k, v in vars(proto).items() if k != "_no_grad"})
    return module


class ContextInjector:
    """One projection for all draft layers' context K/V, then norm + RoPE + cache write.

    The stacked K/V weight is the only copy: each layer's k_proj/v_proj parameters
    are re-pointed to row slices of it (MLX slices share the buffer).
    """

    def __init__(self, drafter: DFlashDraftModel):
        self.drafter = drafter
        attns = [layer.self_attn for layer in drafter.layers]
        proto = attns[0].k_proj
        self.num_layers = len(attns)
        self.num_kv_heads = attns[0].n_kv_heads
        self.head_dim = drafter.args.head_dim
        self.projection = _unfilled_like(proto)
        rows = self.num_kv_heads * self.head_dim
        for name in _STACKED:
            if name not in proto:
                continue
            parts = [getattr(proj, name) for a in attns for proj in (a.k_proj, a.v_proj)]
            stacked = mx.concatenate(parts, axis=0)
            mx.eval(stacked)
            setattr(self.projection, name, stacked)
            for i, a in enumerate(attns):
                for j, proj in enumerate((a.k_proj, a.v_proj)):
                    start = (2 * i + j) * rows
                    setattr(proj, name, stacked[start : start + rows])
        self.k_norm_weight = mx.stack([a.k_norm.weight for a in attns])
        # Evaluated here (the slices are views): a lazy graph built on this thread could not be
        # evaluated by another one, and sessions built here may be decoded on a server's worker.
        mx.eval(self.k_norm_weight, [getattr(proj, name) for a in attns for proj in (a.k_proj, a.v_proj)
                                     for name in _STACKED if name in proj])
        self.eps = attns[0].k_norm.eps
        self.wide = False  # project the target's features in float32 (set when float16 overflowed)

    @classmethod
    def for_drafter(cls, drafter: DFlashDraftModel) -> ContextInjector:
        """The drafter's injector, built once and rebuilt only if its K/V weights were replaced
        (e.g. by training): repeated generations then share one stacked weight."""
        weights = [p.weight for layer in drafter.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        cached = getattr(drafter, "_context_injector", None)
        if cached is None or any(a is not b for a, b in zip(cached.source_weights, weights, strict=True)):
            cached = cls(drafter)
            cached.source_weights = [p.weight for layer in drafter.layers
                                     for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
            drafter._context_injector = cached
        return cached

    def project(self, context: mx.array) -> mx.array:
        """Fused context features (B, n, D) -> kv (B, n, layers, 2, kv_heads, head_dim)."""
        B, n, _ = context.shape
        kv = self.projection(context)
        return kv.reshape(B, n, self.num_layers, 2, self.num_kv_heads, self.head_dim)

    def _fuse(self, target_hidden: mx.array) -> mx.array:
        if self.wide:
            # float16 overflows in the projection of large features: project in float32, then the
            # normed context (order one) goes back to the features' dtype.
            return self.drafter.fuse_context(target_hidden.astype(mx.float32)).astype(target_hidden.dtype)
        return self.drafter.fuse_context(target_hidden)

    def rows(self, target_hidden: mx.array, offsets: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """A batch's context K/V: features (B, n, k*D), row b's first at offsets[b] (B,) ->
        keys, values (layers, B, kv_heads, n, head_dim) (the kernel takes one offset: the reference)."""
        return inject_context_kv_reference(kv=self.project(self._fuse(target_hidden)), k_norm_weight=self.k_norm_weight,
                                           eps=self.eps, rope=self.drafter.rope, offset=offsets, dtype=dtype)

    def __call__(self, target_hidden: mx.array, offset: int, cache: DraftContextCache) -> None:
        """Fuse target features (B, n, k*D) at absolute `offset` and append them to `cache`."""
        if offset != cache.offset:
            raise ValueError(f"injecting at position {offset} but the draft cache ends at {cache.offset}")
        context = self._fuse(target_hidden)
        backend = kernels.backend()
        tables = kernels.rope_tables(self.drafter.rope, self.head_dim) if backend else None
        if tables is not None:
            # One launch for every layer's norm, RoPE, casts and cache layout.
            keys, values = kernels.inject_context_kv(
                kv=self.project(context),
                k_norm_weight=self.k_norm_weight,
                eps=self.eps,
                tables=tables,
                offset=offset,
                dtype=cache.dtype,
                backend=backend,
            )
        else:
            keys, values = inject_context_kv_reference(
                kv=self.project(context),
                k_norm_weight=self.k_norm_weight,
                eps=self.eps,
                rope=self.drafter.rope,
                offset=offset,
                dtype=cache.dtype,
            )
        cache.append(list(keys), list(values))
