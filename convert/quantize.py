"""Quantization recipes, and moving between packed (quantized) and plain weights."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_dflash.errors import DFlashError

from .progress import ProgressFn, no_progress

BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
RECIPES = ("mixed", "uniform")
# In the mixed recipe the vocabulary-sized matrices keep 8 bits: they are read once
# per token and errors there hit every logit.
VOCAB_LAYERS = ("lm_head", "embed_tokens")
# DFlash2 drafters' convolution-kernel and selector projections stay dense too: tiny, and
# they steer every drafted token (the codebooks and base kernels are plain tables, never quantized).
DRAFTER_DENSE_SUFFIXES = ("_conv.kernel_projection", "candidate_selector.hidden_projection")


def check_quant_options(bits: int, group_size: int, recipe: str) -> None:
    if bits not in BITS:
        raise DFlashError(f"--q-bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise DFlashError(f"--q-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if recipe not in RECIPES:
        raise DFlashError(f"--q-recipe must be one of {', '.join(RECIPES)}, got {recipe}")


def quantize(model: nn.Module, *, bits: int, group_size: int, recipe: str, drafter: bool,
             progress: ProgressFn = no_progress) -> dict[str, Any]:
    """Quantize `model` in place; returns the config `quantization` block (with per-layer overrides)."""
    check_quant_options(bits, group_size, recipe)
    block: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    candidates = [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]
    done = 0

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        nonlocal done
        if not hasattr(module, "to_quantized"):
            return False
        done += 1
        progress("quantize", done, len(candidates))
        if module.weight.shape[-1] % group_size:
            return False
        if recipe == "mixed":
            # The drafter's fc fuses several target layers' features: small, and sensitive.
            if drafter and (path == "fc" or path.endswith(DRAFTER_DENSE_SUFFIXES)):
                return False
            if not drafter and path.split(".")[-1] in VOCAB_LAYERS and bits < 8:
                block[path] = {"group_size": group_size, "bits": 8}
                return block[path]
        return True

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    return block


def packed_layers(weights: dict[str, mx.array]) -> dict[str, dict[str, int]]:
    """{layer path: {bits, group_size}} for every packed weight, inferred from the shapes."""
    out = {}
    for key in weights:
        if not key.endswith(".scales"):
            continue
        prefix = key[: -len(".scales")]
        w, s = weights[f"{prefix}.weight"], weights[key]
        # Each uint32 packs 32 / bits values; each scale covers one group.
        for group_size in (32, 64, 128):
            bits = w.shape[-1] * 32 // (s.shape[-1] * group_size)
            if bits in BITS and w.shape[-1] * 32 == bits * s.shape[-1] * group_size:
                out[prefix] = {"group_size": group_size, "bits": bits}
                break
        else:
            raise DFlashError(f"{prefix}: cannot infer the quantization of a packed weight")
    return out


def match_packed(model: nn.Module, layers: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Give `model` quantized layers where the weights are packed; returns the config block."""
    if not layers:
        return {}
    first = next(iter(layers.values()))
    block: dict[str, Any] = {"group_size": first["group_size"], "bits": first["bits"], "mode": "affine"}
    for path, params in layers.items():
        if params != first:
            block[path] = dict(params)

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        return layers.get(path, False) if hasattr(module, "to_quantized") else False

    nn.quantize(model, group_size=first["group_size"], bits=first["bits"], class_predicate=predicate)
    return block


def unpack(weights: dict[str, mx.array], dtype: mx.Dtype = mx.float32) -> dict[str, mx.array]:
    """Dequantize every packed weight (before re-quantizing with other settings)."""
    layers = packed_layers(weights)
    out = {k: v for k, v in weights.items() if not any(k == f"{p}.scales" or k == f"{p}.biases" for p in layers)}
    for prefix, q in layers.items():
        out[f"{prefix}.weight"] = mx.dequantize(
            weights[f"{prefix}.weight"], weights[f"{prefix}.scales"], weights.get(f"{prefix}.biases"),
            group_size=q["group_size"], bits=q["bits"],
        ).astype(dtype)
    return out
