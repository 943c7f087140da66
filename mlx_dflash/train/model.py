"""The drafter's training forward: many draft blocks of one sequence in one pass.

Built from the drafter's own submodules (the same q/k/v/o projections, norms,
RoPE and MLP as `DFlashDraftModel.__call__`), so a block here computes what
inference computes. Block j starts at anchor a_j: its first token is the known
token at a_j, the rest are mask tokens, at positions a_j .. a_j + B - 1. Its
queries see the context features of positions < a_j (at inference the context
holds every committed position but the pending one, which starts the block)
and every position of block j, nothing else.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..drafters.dflash import Attention, DecoderLayer, DFlashDraftModel
from ..targets.model import TargetModel


def block_token_ids(tokens: mx.array, anchors: mx.array, block_size: int, mask_token_id: int) -> mx.array:
    """(B, T) tokens, (B, N) anchors -> (B, N, block_size): the anchor token, then masks."""
    first = mx.take_along_axis(tokens, anchors, axis=1)[..., None]
    masks = mx.full((*anchors.shape, block_size - 1), mask_token_id, dtype=tokens.dtype)
    return mx.concatenate([first, masks], axis=-1)


def attention_mask(anchors: mx.array, context_len: int, block_size: int) -> mx.array:
    """Boolean (B, 1, N*bs, T + N*bs): context before the anchor, and the own block."""
    B, N = anchors.shape
    L = N * block_size
    sees_context = mx.arange(context_len)[None, None, :] < anchors[:, :, None]  # (B, N, T)
    sees_context = mx.repeat(sees_context, block_size, axis=1)  # (B, L, T)
    block_of = mx.arange(L) // block_size
    own_block = block_of[:, None] == block_of[None, :]  # (L, L)
    own_block = mx.broadcast_to(own_block[None], (B, L, L))
    return mx.concatenate([sees_context, own_block], axis=-1)[:, None]


def _rotate_blocks(rope: nn.Module, x: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """(B, L, heads, hd) block projections -> (B, heads, L, hd) rotated at anchor + k."""
    B, L, H, hd = x.shape
    N = anchors.shape[1]
    x = x.reshape(B, N, block_size, H, hd).transpose(0, 1, 3, 2, 4).reshape(B * N, H, block_size, hd)
    x = rope(x, offset=anchors.reshape(-1))
    return x.reshape(B, N, H, block_size, hd).transpose(0, 2, 1, 3, 4).reshape(B, H, L, hd)


def _context_kv(attn: Attention, rope: nn.Module, context: mx.array) -> tuple[mx.array, mx.array]:
    """Context K/V at absolute positions 0..T-1, as the injector writes them into the cache."""
    B, T, _ = context.shape
    k = attn.k_norm(attn.k_proj(context).reshape(B, T, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(context).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return rope(k, offset=0), v


def _attention(attn: Attention, rope: nn.Module, x: mx.array, context: mx.array, anchors: mx.array,
               block_size: int, mask: mx.array) -> mx.array:
    B, L, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).reshape(B, L, attn.n_heads, -1))
    k = attn.k_norm(attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1))
    v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = _rotate_blocks(rope, q, anchors, block_size)
    k = _rotate_blocks(rope, k, anchors, block_size)
    ctx_k, ctx_v = _context_kv(attn, rope, context)
    keys = mx.concatenate([ctx_k, k], axis=2)
    values = mx.concatenate([ctx_v, v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _layer(layer: DecoderLayer, rope: nn.Module, x: mx.array, context: mx.array, anchors: mx.array,
           block_size: int, mask: mx.array) -> mx.array:
    h = x + _attention(layer.self_attn, rope, layer.input_layernorm(x), context, anchors, block_size, mask)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def draft_blocks(drafter: DFlashDraftModel, block_embeddings: mx.array, target_features: mx.array,
                 anchors: mx.array) -> mx.array:
    """The training forward of every block of a batch in one pass.

    block_embeddings: (B, N, block_size, D), the target's embedding of `block_token_ids`.
    target_features: (B, T, k*D), the selected target layers' outputs for every position.
    anchors: (B, N) block start positions (padding anchors may be 0: they see no context).
    Returns final-normed hidden states (B, N, block_size, D); the target's lm_head follows.
    """
    B, N, block_size, D = block_embeddings.shape
    context = drafter.fuse_context(target_features)
    mask = attention_mask(anchors, context.shape[1], block_size)
    h = block_embeddings.reshape(B, N * block_size, D)
    for layer in drafter.layers:
        h = _layer(layer, drafter.rope, h, context, anchors, block_size, mask)
    return drafter.norm(h).reshape(B, N, block_size, D)


def init_from_target(drafter: DFlashDraftModel, target: TargetModel) -> list[str]:
    """Start the drafter from the target: its final norm, and its top layers' weights.

    The drafter borrows the target's lm_head, whose inputs the target's final norm
    calibrates; draft layer i starts as target layer n - L + i (the layers that turn
    features into next-token predictions) wherever the shapes agree. The q/k norms,
    which the target may not have, stay at one. Returns the names copied.
    """
    drafter_params = dict(tree_flatten(drafter.parameters()))
    copied = {"norm.weight": target.inner.norm.weight}
    top = target.inner.layers[len(target.inner.layers) - len(drafter.layers):]
    for i, layer in enumerate(top):
        for name, value in tree_flatten(layer.parameters()):
            key = f"layers.{i}.{name}"
            if key in drafter_params and drafter_params[key].shape == value.shape:
                copied[key] = value
    drafter.load_weights([(k, v.astype(drafter_params[k].dtype)) for k, v in copied.items()], strict=False)
    mx.eval(drafter.parameters())
    return sorted(copied)
