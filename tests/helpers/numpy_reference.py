"""An independent numpy reference of the DFlash drafter (float64), and the numpy primitives it is built of.

Written from the method's description, not from the code it checks: RMSNorm, "rotate half" RoPE,
SiLU, softmax, and `reference_draft`, the draft block's hidden states and logits.
"""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, positions, theta):
    """Non-interleaved RoPE ("rotate half", as Qwen3/HF do). x: (..., L, head_dim)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # (L, d/2)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference_draft(w, cfg, features, block_tokens, embedding, lm_head, context_window=None):  # noqa: C901
    """Hidden states (L, D) and logits (L, V) of the draft block after n context positions.

    w: drafter weights by checkpoint key (numpy float64); features: (n, k*D) target
    features of positions 0..n-1; block_tokens: [last token, MASK, ...] at positions n...
    """
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n, L = features.shape[0], len(block_tokens)
    ctx = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (n, D)
    ctx_pos, blk_pos = np.arange(n), np.arange(n, n + L)
    if context_window is not None:  # the drafter sees only the last `window` context positions
        ctx, ctx_pos = ctx[-context_window:], ctx_pos[-context_window:]
    all_ctx, all_pos = ctx, ctx_pos
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    x = embedding[block_tokens]  # (L, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        ctx, ctx_pos = all_ctx, all_pos
        if layer_types[i] == "sliding_attention":  # this layer sees the last `sliding_window` only
            ctx, ctx_pos = all_ctx[-cfg["sliding_window"]:], all_pos[-cfg["sliding_window"]:]
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)

        def heads_of(t, proj, count, p=p):
            return (t @ w[p + f"self_attn.{proj}.weight"].T).reshape(len(t), count, hd).transpose(1, 0, 2)

        q = rope(rms_norm(heads_of(h, "q_proj", heads), w[p + "self_attn.q_norm.weight"], eps), blk_pos, theta)
        k_ctx = rope(rms_norm(heads_of(ctx, "k_proj", kv_heads), w[p + "self_attn.k_norm.weight"], eps),
                     ctx_pos, theta)
        k_blk = rope(rms_norm(heads_of(h, "k_proj", kv_heads), w[p + "self_attn.k_norm.weight"], eps),
                     blk_pos, theta)
        v_ctx, v_blk = heads_of(ctx, "v_proj", kv_heads), heads_of(h, "v_proj", kv_heads)
        k = np.concatenate([k_ctx, k_blk], axis=1)  # (kv_heads, m + L, hd)
        v = np.concatenate([v_ctx, v_blk], axis=1)
        group = heads // kv_heads
        out = np.empty((heads, L, hd))
        for head in range(heads):  # GQA: query head `head` reads kv head `head // group`
            scores = q[head] @ k[head // group].T / np.sqrt(hd)  # no mask: non-causal
            out[head] = softmax(scores) @ v[head // group]
        x = x + out.transpose(1, 0, 2).reshape(L, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        mlp = silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    hidden = rms_norm(x, w["norm.weight"], eps)
    return hidden, hidden @ lm_head.T


def numpy_weights(module) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(module.parameters())}


def target_head(target_model):
    t = numpy_weights(target_model)
    embedding = t["model.embed_tokens.weight"]
    return embedding, t.get("lm_head.weight", embedding)
