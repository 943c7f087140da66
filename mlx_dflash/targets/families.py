"""How each mlx-lm model family runs, rebuilt from the model's own parts.

A family says where the decoder lives (`text_model`), how the input is
embedded (Gemma scales it), which mask each layer gets (full, sliding-window,
recurrent), and, where the model's own loop is unusual (Gemma 4's per-layer
inputs and shared K/V), the loop itself. Each reproduces mlx-lm's `__call__`
of that family op for op, so capturing hidden states costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

LayerHook = Callable[[int, mx.array], None]
# layer index -> the recurrent mixer's input, recorded during a verify pass for cheap rollback
MixerInputs = dict[int, mx.array]


def shared_causal_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    return [create_attention_mask(h, cache[0])] * len(inner.layers)


def llama_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # Llama/Mistral in mlx-lm may mix full and sliding-window layers.
    full = create_attention_mask(h, cache[inner.fa_idx])
    if inner.swa_idx is None:
        return [full] * len(inner.layers)
    window = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
    return [window if layer.use_sliding else full for layer in inner.layers]


def hybrid_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # Qwen3.5 / Qwen3-Next: GatedDeltaNet layers take an SSM mask, attention layers a causal one.
    full = create_attention_mask(h, cache[inner.fa_idx]) if inner.fa_idx is not None else None
    ssm = create_ssm_mask(h, cache[inner.ssm_idx]) if inner.ssm_idx is not None else None
    return [ssm if layer.is_linear else full for layer in inner.layers]


def gpt_oss_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    full = create_attention_mask(h, cache[inner.ga_idx])
    window = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
    return [full if t == "full_attention" else window for t in inner.layer_types]


def gemma3_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    pattern = inner.sliding_window_pattern
    full = create_attention_mask(h, cache[pattern - 1])
    window = create_attention_mask(h, cache[0], window_size=inner.window_size) if pattern > 1 else None
    return [full if i % pattern == pattern - 1 else window for i in range(len(inner.layers))]


def gemma3_embed(inner: nn.Module, tokens: mx.array) -> mx.array:
    h = inner.embed_tokens(tokens)
    # As mlx-lm does: the scale is rounded to bfloat16 first.
    return h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def gemma4_embed(inner: nn.Module, tokens: mx.array) -> mx.array:
    return inner.embed_tokens(tokens) * inner.embed_scale


def hybrid_layers(inner: nn.Module, tokens: mx.array, h: mx.array, cache: list[Any], hook: LayerHook,
                  record: MixerInputs | None = None) -> mx.array:
    """Qwen3.5 / Qwen3-Next decoder layers, keeping each GatedDeltaNet mixer's input.

    Rolling back then only re-runs the recurrent mixers on the kept positions.
    """
    masks = hybrid_masks(inner, h, cache)
    for i, (layer, c, mask) in enumerate(zip(inner.layers, cache, masks, strict=True)):
        x = layer.input_layernorm(h)
        if layer.is_linear:
            if record is not None:
                record[i] = x
            h = h + layer.linear_attn(x, mask, c)
        else:
            h = h + layer.self_attn(x, mask, c)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        hook(i, h)
    return h


def replay_mixer(inner: nn.Module, layer: int, inputs: mx.array, cache: Any) -> None:
    """Advance one recurrent layer's state over recorded mixer inputs."""
    inner.layers[layer].linear_attn(inputs, None, cache)


def gemma4_layers(inner: nn.Module, tokens: mx.array, h: mx.array, cache: list[Any], hook: LayerHook,
                  record: MixerInputs | None = None) -> mx.array:
    """Gemma 4's loop: per-layer input embeddings and K/V shared across late layers."""
    per_layer = None
    if inner.hidden_size_per_layer_input:
        per_layer = inner._get_per_layer_inputs(tokens, inner.embed_tokens(tokens))
        per_layer = inner._project_per_layer_inputs(h, per_layer)
    per_layer_inputs = [
        per_layer[:, :, i, :] if per_layer is not None else None for i in range(len(inner.layers))
    ]
    cache = cache + [None] * (len(inner.layers) - len(cache))
    masks = inner._make_masks(h, cache)
    intermediates: list[tuple[Any, Any]] = [(None, None)] * len(inner.layers)
    for i, layer in enumerate(inner.layers):
        kvs, offset = intermediates[inner.previous_kvs[i]]
        h, kvs, offset = layer(h, masks[i], cache[i], per_layer_input=per_layer_inputs[i],
                               shared_kv=kvs, offset=offset)
        intermediates[i] = (kvs, offset)
        hook(i, h)
    return h


def softcap_gemma4(owner: nn.Module, logits: mx.array) -> mx.array:
    cap = getattr(owner, "final_logit_softcapping", None)
    return mx.tanh(logits / cap) * cap if cap is not None else logits


@dataclass(frozen=True)
class TargetFamily:
    model_types: tuple[str, ...]
    build_masks: Callable[[nn.Module, mx.array, list[Any]], list[Any]] | None = None
    embed: Callable[[nn.Module, mx.array], mx.array] | None = None
    run_layers: Callable[..., mx.array] | None = None
    finish_logits: Callable[[nn.Module, mx.array], mx.array] | None = None
    replay_mixer: Callable[[nn.Module, int, mx.array, Any], None] | None = None

    @staticmethod
    def text_model(model: nn.Module) -> nn.Module:
        """The module holding `.model` (the decoder), `.args` and the lm_head."""
        return model.language_model if "language_model" in model else model


FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily(("qwen3", "qwen3_moe", "qwen2"), shared_causal_masks),
    TargetFamily(("llama", "mistral"), llama_masks),
    TargetFamily(("qwen3_5", "qwen3_5_moe", "qwen3_next"), run_layers=hybrid_layers,
                 replay_mixer=replay_mixer),
    TargetFamily(("gpt_oss",), gpt_oss_masks),
    TargetFamily(("gemma3", "gemma3_text"), gemma3_masks, embed=gemma3_embed),
    TargetFamily(("gemma4", "gemma4_text"), embed=gemma4_embed, run_layers=gemma4_layers,
                 finish_logits=softcap_gemma4),
)
