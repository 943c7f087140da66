"""Writing a trained drafter: the z-lab Hugging Face layout, optionally quantized for MLX.

The z-lab layout is config.json (with `dflash_config`) plus model.safetensors
whose keys are the drafter's parameter names (no embedding, no lm_head), so
the same files load here, in the z-lab reference, vLLM and SGLang. The
quantized variant is MLX-only (packed weights plus a `quantization` block).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..drafters.dflash import DFlashDraftModel
from ..errors import DFlashError
from . import recipe

DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def drafter_config(args: Any, dtype: mx.Dtype = mx.float32) -> dict[str, Any]:
    """The z-lab config.json of a drafter with these ModelArgs."""
    return recipe.drafter_config(args, DTYPE_NAMES.get(dtype, "float32"))


def export_drafter(drafter: DFlashDraftModel, out_dir: str | Path, *, dtype: mx.Dtype = mx.float16,
                   quantize_bits: int | None = None, group_size: int = 64) -> Path:
    """Write `drafter` to `out_dir` (created; existing weight files are replaced).

    quantize_bits: None for the z-lab format in `dtype`; 4 or 8 for MLX's
    quantized format (projections packed, `fc` and norms kept in `dtype`).
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"{out}: cannot create the export directory ({e.strerror})") from None
    # A fresh copy, so the caller's (training) drafter is never cast or quantized.
    model = DFlashDraftModel(drafter.args)
    model.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(drafter.parameters())])
    config = drafter_config(drafter.args, dtype)
    if quantize_bits is not None:
        from ..convert.quantize import quantize

        config["quantization"] = quantize(model, bits=quantize_bits, group_size=group_size, recipe="mixed",
                                          drafter=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return out
