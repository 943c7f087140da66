"""The target's forward over a draft tree, and the compaction of the branch it accepted.

A tree verify feeds the pending token and every tree node in one pass. Each node sits at
the position of its depth (the pending token's position plus the depth) and attends to the
committed context, its ancestors and itself only. mlx-lm's attention takes one RoPE offset
per sequence, so the attention of the families below is run from its parts with one offset
per token: the nodes are laid along the batch axis for the rotation alone, where
`mx.fast.rope` takes an offset per row. Everything else (norms, projections, MLP, SDPA with
quantized caches too) is the layer's own module.

`tree_refusal` says why a target cannot verify trees (None: it can), and checks once per
target that the rebuilt pass over a chain (a tree with one branch) equals the family's own
forward exactly. After the verify, `compact` moves the accepted branch's K/V to the
positions right after the context and drops the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .model import TargetModel

TREE_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_COMPACTABLE = (KVCache, QuantizedKVCache)
# id of the mlx-lm model -> the reason found once (a `TargetModel` is rebuilt around the same model per
# generation); an entry goes with its model.
_refusals: dict[int, str | None] = {}


def tree_refusal(target: TargetModel) -> str | None:
    """Why `target` cannot verify draft trees, or None when it can (checked once per model)."""
    key = id(target.model)
    if key not in _refusals:
        _refusals[key] = _find_refusal(target)
        weakref.finalize(target.model, _refusals.pop, key, None)
    return _refusals[key]


def _find_refusal(target: TargetModel) -> str | None:
    if target.world is not None:
        return "a distributed target verifies linear blocks only"
    if target.model_type not in TREE_MODEL_TYPES:
        return (f"{target.model_type} targets verify linear blocks only (trees: "
                + ", ".join(TREE_MODEL_TYPES) + ")")
    cache = target.make_cache()
    if any(not isinstance(c, _COMPACTABLE) for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if not isinstance(c, _COMPACTABLE)})
        return f"its {', '.join(kinds)} caches (sliding-window or recurrent) cannot drop a tree's other branches"
    for layer in target.inner.layers:
        if not all(hasattr(layer, p) for p in _LAYER_PARTS) or \
                not all(hasattr(layer.self_attn, p) for p in _ATTENTION_PARTS):
            return f"its {type(layer).__name__} layers are not the standard attention block"
    return _chain_check(target)


def _chain_check(target: TargetModel) -> str | None:
    """A chain of 6 tokens through the tree pass, after a 3-token context, must equal the
    family's own forward exactly (positions and mask are then those of a plain block)."""
    tokens = mx.array([1, 5, 9, 2, 7, 3, 4, 8, 6], dtype=mx.uint32)
    ours, theirs = target.make_cache(), target.make_cache()
    for cache in (ours, theirs):
        target.forward(tokens[None, :3], cache)
    chain = mx.tril(mx.ones((6, 6), dtype=mx.bool_))
    h_ours, _ = tree_forward(target, tokens[3:], mx.arange(6), chain, ours)
    h_theirs, _ = target.forward(tokens[None, 3:], theirs)
    if not mx.array_equal(h_ours, h_theirs).item():
        return f"the tree pass of this {target.model_type} model differs from its own forward"
    return None


def _rope_at(rope: Any, x: mx.array, positions: mx.array) -> mx.array:
    # (1, H, L, hd) -> (L, H, 1, hd): one sequence per token, each rotated at its own offset.
    return rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)


def _attention(attn: Any, x: mx.array, mask: mx.array, cache: Any, positions: mx.array) -> mx.array:
    batch, length, _ = x.shape
    queries = attn.q_proj(x).reshape(batch, length, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(batch, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotation
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = _rope_at(attn.rope, queries.transpose(0, 2, 1, 3), positions)
    keys = _rope_at(attn.rope, keys.transpose(0, 2, 1, 3), positions)
    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def tree_forward(target: TargetModel, tokens: mx.array, depths: mx.array, visible: mx.array,
                 cache: list[Any], capture: Sequence[int] = ()) -> tuple[mx.array, mx.array | None]:
    """Run the tree's inputs `tokens` (N,) through the target, appending them to `cache`.

    `depths` (N,): each input's depth (0 for the pending token); `visible` (N, N) bool: input i
    sees input j. Returns the final-normed hidden states (1, N, D) and the captured layers'
    outputs (1, N, k*D), as `TargetModel.forward` does.
    """
    start = cache[0].offset
    positions = (depths + start).astype(mx.int32)
    mask = mx.concatenate([mx.ones((visible.shape[0], start), dtype=mx.bool_), visible], axis=1) \
        if start else visible
    h = target.embed(tokens[None])
    captured: list[mx.array | None] = [None] * len(capture)
    for i, (layer, c) in enumerate(zip(target.inner.layers, cache, strict=True)):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), mask, c, positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        for slot, layer_id in enumerate(capture):
            if layer_id == i:
                captured[slot] = h
    features = mx.concatenate(captured, axis=-1) if capture else None
    return target.inner.norm(h), features


def compact(cache: list[Any], start: int, kept: Sequence[int], fed: int) -> None:
    """Keep, of the `fed` positions appended from `start`, those at `kept` (ascending offsets
    from `start`), moved to `start`, `start + 1`, ...; drop the rest."""
    if list(kept) != list(range(len(kept))):
        rows = mx.array([start + k for k in kept], dtype=mx.int32)
        for c in cache:
            c.keys, c.values = _gather_rows(c.keys, start, rows), _gather_rows(c.values, start, rows)
    for c in cache:
        c.trim(fed - len(kept))


def _gather_rows(value: Any, start: int, rows: mx.array) -> Any:
    if isinstance(value, (tuple, list)):  # a quantized cache: packed values, scales, biases
        return type(value)(_gather_rows(v, start, rows) for v in value)
    value[..., start : start + rows.shape[0], :] = value[..., rows, :]
    return value
