"""The target model side: a forward pass that also returns selected layers' outputs.

mlx-lm models have no hidden-state hook, so each supported family gets a
forward built from the model's own parts (embedding, mask, layers, norm,
lm_head) that reproduces `model(x)` exactly while keeping the outputs of the
selected decoder layers (Hugging Face `hidden_states[i + 1]`). Nothing in
mlx-lm is patched. A family is a `TargetFamily`: how to build the masks, how
to make the cache, and how to roll it back after a partially accepted block;
hybrid and sliding-window families plug in here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from .errors import DFlashError

MaskBuilder = Callable[[nn.Module, mx.array, list[Any]], list[Any]]


def _shared_causal_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    mask = create_attention_mask(h, cache[0])
    return [mask] * len(inner.layers)


def _llama_masks(inner: nn.Module, h: mx.array, cache: list[Any]) -> list[Any]:
    # Llama/Mistral in mlx-lm may mix full and sliding-window layers.
    full = create_attention_mask(h, cache[inner.fa_idx])
    if inner.swa_idx is None:
        return [full] * len(inner.layers)
    window = create_attention_mask(h, cache[inner.swa_idx], window_size=inner.sliding_window)
    return [window if layer.use_sliding else full for layer in inner.layers]


def _trim_attention_caches(cache: list[Any], num_tokens: int) -> None:
    for c in cache:
        if not c.is_trimmable():
            raise DFlashError(f"target cache {type(c).__name__} cannot be rolled back")
        c.trim(num_tokens)


@dataclass(frozen=True)
class TargetFamily:
    """How to run one mlx-lm model family with hidden-state capture and rollback."""

    model_types: tuple[str, ...]
    build_masks: MaskBuilder
    rollback: Callable[[list[Any], int], None] = _trim_attention_caches

    def make_cache(self, model: nn.Module) -> list[Any]:
        return make_prompt_cache(model)


FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily(("qwen3", "qwen3_moe", "qwen2"), _shared_causal_masks),
    TargetFamily(("llama", "mistral"), _llama_masks),
)


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(model_type: str) -> TargetFamily:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise DFlashError(
        f"target model type '{model_type}' is not supported; supported types: "
        + ", ".join(supported_model_types())
    )


class TargetModel:
    """An mlx-lm causal LM with a capturing forward pass and cache rollback."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_type = getattr(model, "model_type", None) or model.args.model_type
        self.family = family_for(self.model_type)
        self.inner = model.model
        self.args = model.args

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table (the ids the drafter may embed)."""
        return self.inner.embed_tokens.weight.shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        return self.inner.norm.weight.dtype

    def make_cache(self) -> list[Any]:
        return self.family.make_cache(self.model)

    def rollback(self, cache: list[Any], num_tokens: int) -> None:
        """Drop the last `num_tokens` positions from the target cache."""
        if num_tokens > 0:
            self.family.rollback(cache, num_tokens)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def logits(self, hidden: mx.array) -> mx.array:
        """Final-normed hidden states -> logits (the lm_head, or the tied embedding)."""
        if getattr(self.args, "tie_word_embeddings", False) or not hasattr(self.model, "lm_head"):
            return self.inner.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def forward(
        self, tokens: mx.array, cache: list[Any], capture: Sequence[int] = ()
    ) -> tuple[mx.array, mx.array | None]:
        """Run the decoder on `tokens` (B, L), updating `cache`.

        Returns the final-normed hidden states (B, L, D) and the outputs of the
        `capture` layers concatenated on the feature axis (B, L, len(capture)*D),
        or None when nothing is captured.
        """
        h = self.embed(tokens)
        masks = self.family.build_masks(self.inner, h, cache)
        wanted = {layer: slot for slot, layer in enumerate(capture)}
        captured: list[mx.array | None] = [None] * len(capture)
        for i, (layer, c, mask) in enumerate(zip(self.inner.layers, cache, masks, strict=True)):
            h = layer(h, mask, c)
            if i in wanted:
                captured[wanted[i]] = h
        features = mx.concatenate(captured, axis=-1) if capture else None
        return self.inner.norm(h), features
