"""What the injection kernels share: the per-row norm + RoPE body, selection, lazy builds.

Every kernel runs one thread per head_dim row with the loop over head_dim inside
(no SIMD-group reductions), so the host emulation in tests/ runs the very same
source thread by thread on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# auto: each kernel checks itself against its reference on first use (mlx_dflash.kernels.self_check);
# off: the pure-MLX path only; on: the kernels without the check.
MODE_ENV = "MLX_DFLASH_KERNELS"
MODES = ("auto", "off", "on")
KILL_SWITCH_ENV = "MLX_DFLASH_NO_KERNELS"  # set: the same as MLX_DFLASH_KERNELS=off
# The CUDA twin has not been checked on a device yet, so it is opt-in.
CUDA_OPT_IN_ENV = "MLX_DFLASH_CUDA_KERNELS"

# Normalise one head_dim row in float32, apply its norm weight and the rope's input
# scale, rotate pairs (i, i + D/2) (MLX's non-traditional layout) at `position`, cast.
# precise:: cos/sin because fast-math trig loses accuracy at large angles (long contexts).
ROW_HEADER = """
#ifndef DFLASH_FN
#define DFLASH_FN inline
#endif
template <int D, typename TIn, typename TW, typename TOut>
DFLASH_FN void dflash_norm_rope_row(
    const device TIn* src,
    const device TW* weight,
    const device float* inv_freq,
    float eps,
    float position,
    float input_scale,
    device TOut* dst) {
  float sum_sq = 0.0f;
  for (int i = 0; i < D; ++i) {
    float x = static_cast<float>(src[i]);
    sum_sq += x * x;
  }
  float inv_rms = metal::precise::rsqrt(sum_sq / D + eps);
  for (int i = 0; i < D / 2; ++i) {
    float a = static_cast<float>(src[i]) * inv_rms * static_cast<float>(weight[i]) * input_scale;
    float b = static_cast<float>(src[i + D / 2]) * inv_rms * static_cast<float>(weight[i + D / 2]) * input_scale;
    float theta = position * inv_freq[i];
    float c = metal::precise::cos(theta);
    float s = metal::precise::sin(theta);
    dst[i] = static_cast<TOut>(a * c - b * s);
    dst[i + D / 2] = static_cast<TOut>(a * s + b * c);
  }
}
"""

# The CUDA twin compiles the same header and body: these lines supply what Metal has built in.
CUDA_HEADER = """
#define DFLASH_FN __device__ inline
#define device
#define constant
typedef unsigned int uint;
namespace metal {
namespace precise {
__device__ inline float rsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ inline float cos(float x) { return ::cosf(x); }
__device__ inline float sin(float x) { return ::sinf(x); }
}
}
"""
CUDA_PROLOGUE = """
const uint3 thread_position_in_grid = make_uint3(
    blockIdx.x * blockDim.x + threadIdx.x,
    blockIdx.y * blockDim.y + threadIdx.y,
    blockIdx.z * blockDim.z + threadIdx.z);
"""

THREADGROUP = 64


@dataclass(frozen=True)
class KernelSpec:
    """A kernel as `mx.fast.metal_kernel` takes it; tests/helpers/emulate_metal.py reads the same fields."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ROW_HEADER


def mode() -> str:
    """MLX_DFLASH_KERNELS as one of MODES (an unknown value is an error, not a silent default)."""
    if os.environ.get(KILL_SWITCH_ENV):
        return "off"
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def backend() -> str | None:
    """'metal' or 'cuda' where the kernels should run, None for the pure-MLX path."""
    if mode() == "off":
        return None
    if mx.metal.is_available():
        return "metal"
    if os.environ.get(CUDA_OPT_IN_ENV) and mx.cuda.is_available():
        return "cuda"
    return None


_BUILT: dict[tuple[str, str], Any] = {}


def compiled(spec: KernelSpec, kind: str) -> Any:
    """The kernel object for `kind` ('metal' or 'cuda'), built once on first use."""
    key = (spec.name, kind)
    if key not in _BUILT:
        if kind == "metal":
            _BUILT[key] = mx.fast.metal_kernel(
                name=spec.name, input_names=list(spec.input_names), output_names=list(spec.output_names),
                source=spec.source, header=spec.header,
            )
        elif kind == "cuda":
            _BUILT[key] = mx.fast.cuda_kernel(
                name=spec.name, input_names=list(spec.input_names), output_names=list(spec.output_names),
                source=CUDA_PROLOGUE + spec.source, header=CUDA_HEADER + spec.header,
            )
        else:
            raise ValueError(f"no kernel backend {kind!r}")
    return _BUILT[key]


def norm_rope_rows(
    x: mx.array, weight: mx.array, eps: float, tables: Any, positions: mx.array, dtype: mx.Dtype
) -> mx.array:
    """Pure-MLX twin of `dflash_norm_rope_row` over the last axis of `x`, rows at `positions`
    (broadcast against x's second-to-last axis): float32 inside, one cast at the end."""
    x = x.astype(mx.float32)
    half = x.shape[-1] // 2
    x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    x = x * weight.astype(mx.float32) * tables.input_scale
    theta = (positions.astype(mx.float32) * tables.position_scale)[:, None] * tables.inv_freq
    c, s = mx.cos(theta), mx.sin(theta)
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(dtype)


def grid_for(rows: int) -> dict[str, tuple[int, int, int]]:
    """A 1-D launch of `rows` threads (the grid counts threads, not groups)."""
    return {"grid": (rows, 1, 1), "threadgroup": (min(THREADGROUP, max(rows, 1)), 1, 1)}
