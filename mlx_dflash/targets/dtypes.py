"""Compute dtypes: the names the CLI and API accept, and the default per backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_dtype() -> mx.Dtype | None:
    """float32 on the CPU (MLX's CPU half-precision matmuls are slow); the checkpoint's otherwise."""
    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    return mx.float32


def cast_floats(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """Cast floating-point parameters (not packed quantized weights) to `dtype`."""
    if dtype is None:
        return
    model.update(tree_map(
        lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
        model.parameters(),
    ))
