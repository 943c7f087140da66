"""The injection kernels' test cases, their inputs and their pure-MLX references, shared by the emulated,
the self-check and the on-device kernel tests."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

EPS = 1e-6
F32, F16, BF16 = mx.float32, mx.float16, mx.bfloat16
ULP = {F16: 2.0**-10, BF16: 2.0**-7}


def _longrope(half: int) -> dict:
    return {
        "rope_type": "longrope", "original_max_position_embeddings": 4096,
        "short_factor": [1.0] * half, "long_factor": [1.0 + 0.05 * i for i in range(half)],
    }


ROPES = {
    "default": (1_000_000.0, lambda half: None),
    "linear": (10_000.0, lambda half: {"type": "linear", "factor": 4.0}),
    "llama3": (500_000.0, lambda half: {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }),
    "yarn": (1_000_000.0, lambda half: {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
    }),
    "longrope": (10_000.0, _longrope),
}


def make_rope(name: str, head_dim: int) -> nn.Module:
    base, scaling = ROPES[name]
    return initialize_rope(
        head_dim, base=base, traditional=False, scaling_config=scaling(head_dim // 2),
        max_position_embeddings=131072,
    )


def f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(F32))


def close(actual: mx.array, expected: mx.array, rtol: float, atol: float) -> bool:
    return actual.shape == expected.shape and np.allclose(f32(actual), f32(expected), rtol=rtol, atol=atol)


def check(actual: mx.array, reference: mx.array, reference_f32: mx.array, dtype: mx.Dtype,
          in_dtype: mx.Dtype | None = None) -> None:
    """Within one ulp of the float32 reference cast once to `dtype`; loosely the reference run in the dtypes."""
    assert actual.dtype == dtype and actual.shape == reference.shape
    np.testing.assert_allclose(f32(actual), f32(reference_f32.astype(dtype)), rtol=ULP.get(dtype, 1e-5), atol=1e-5)
    # The reference rounds to the input dtype at every step; the kernel only once, at the end.
    low = in_dtype if in_dtype in ULP else dtype
    tol = 8 * ULP[low] if low in ULP else 1e-5
    np.testing.assert_allclose(f32(actual), f32(reference), rtol=tol, atol=tol)


def context_inputs(B, n, layers, kv_heads, head_dim, in_dtype, seed=0):
    rng = np.random.default_rng(seed)
    kv = mx.array(2.0 * rng.standard_normal((B, n, layers, 2, kv_heads, head_dim)), dtype=F32).astype(in_dtype)
    weight = mx.array(1.0 + 0.2 * rng.standard_normal((layers, head_dim)), dtype=F32).astype(in_dtype)
    return kv, weight


CONTEXT_CASES = [
    # B, n, layers, kv_heads, head_dim, offset, input dtype, cache dtype, rope
    (1, 1, 5, 4, 64, 0, F32, F32, "default"),
    (1, 7, 5, 8, 128, 100_000, F32, F32, "default"),
    (2, 3, 2, 2, 256, 37, F32, F32, "linear"),
    (1, 4, 3, 2, 128, 100_000, F32, F32, "llama3"),
    (1, 4, 3, 2, 128, 100_000, F32, F32, "yarn"),
    (1, 4, 3, 2, 64, 5_000, F32, F32, "longrope"),
    (1, 6, 5, 8, 128, 0, F16, F16, "default"),
    (2, 6, 3, 4, 128, 100_000, BF16, BF16, "yarn"),
    (1, 3, 2, 2, 256, 100_000, F16, F16, "llama3"),
    (1, 5, 2, 2, 64, 12, BF16, F32, "default"),
]


def block_reference(q, k, qw, kw, rope, offset, num_heads, num_kv_heads):
    """The drafter's pure-MLX block path (Attention.__call__ without kernels)."""
    B, L, _ = q.shape
    qn = mx.fast.rms_norm(q.reshape(B, L, num_heads, -1), qw, EPS).transpose(0, 2, 1, 3)
    kn = mx.fast.rms_norm(k.reshape(B, L, num_kv_heads, -1), kw, EPS).transpose(0, 2, 1, 3)
    return rope(qn, offset=offset), rope(kn, offset=offset)


def block_inputs(B, L, num_heads, num_kv_heads, head_dim, dtype, seed=1):
    rng = np.random.default_rng(seed)

    def arr(shape, scale=1.0, shift=0.0):
        return mx.array(shift + scale * rng.standard_normal(shape), dtype=F32).astype(dtype)

    return (arr((B, L, num_heads * head_dim), 2.0), arr((B, L, num_kv_heads * head_dim), 2.0),
            arr((head_dim,), 0.2, 1.0), arr((head_dim,), 0.2, 1.0))


BLOCK_CASES = [
    # B, L, heads, kv_heads, head_dim, offset, dtype, rope
    (1, 16, 8, 2, 128, 0, F32, "default"),
    (2, 8, 4, 4, 64, 100_000, F32, "yarn"),
    (1, 16, 4, 2, 64, 100_000, F32, "longrope"),
    (1, 8, 4, 2, 256, 3, F32, "linear"),
    (1, 16, 32, 8, 128, 100_000, BF16, "default"),
    (1, 4, 4, 1, 256, 77, F16, "llama3"),
]
