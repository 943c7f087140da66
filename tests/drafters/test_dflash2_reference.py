"""DFlash2 drafters against an independent numpy reference.

The reference is written from the checkpoint's description (issue 17): per layer a
grouped dynamic causal convolution over the block on the normed input before each
sublayer and on its output after it (base kernel + per-position, per-group
corrections projected from the normed input); attention as in v1 except that a
sliding layer sees only context keys closer than `sliding_window` to the query and,
with `is_causal` (default: sliding layers), block keys up to the query; logits =
lm_head(h) * output_multiplier, tanh soft-capped; the selector walks the block from
the anchor, scoring each top-k candidate by its logit plus
sum_r P[prev, r] * (W h_t)[r] * S[cand, r]. Loops and absolute positions, numpy only.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.numpy_reference import numpy_weights, rms_norm, rope, silu, softmax, target_head
from helpers.tiny import tiny_target
from helpers.tiny_dflash2 import tiny_dflash2

from mlx_dflash.drafters import selector
from mlx_dflash.drafters.dflash2 import GroupedDynamicConv
from mlx_dflash.proposers.dflash2 import DFlash2Proposer
from mlx_dflash.proposers.factory import dflash_proposer
from mlx_dflash.targets.model import TargetModel

# ---------------------------------------------------------------- the reference


def conv_reference(x, base, corrections, group_size):
    """x (L, D); base (K, D); corrections (L, K, groups): out[t] = sum_o (base[o] + corr[t, o]) * x[t - o]."""
    L, D = x.shape
    out = np.zeros_like(x)
    for t in range(L):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + np.repeat(corrections[t, o], group_size)) * x[t - o]
    return out


def attention_reference(w, p, cfg, h, ctx, n, layer, window):
    """One draft layer's attention output for block input h (L, D) after n context positions."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    L = len(h)
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    sliding = types[layer] == "sliding_attention"
    causal = cfg.get("is_causal", sliding) if cfg.get("is_causal") is not None else sliding

    def heads_of(t, proj, count):
        return (t @ w[p + f"self_attn.{proj}.weight"].T).reshape(len(t), count, hd).transpose(1, 0, 2)

    ctx_pos, blk_pos = np.arange(n), np.arange(n, n + L)
    q = rope(rms_norm(heads_of(h, "q_proj", heads), w[p + "self_attn.q_norm.weight"], eps), blk_pos, theta)
    k = np.concatenate([
        rope(rms_norm(heads_of(ctx, "k_proj", kv_heads), w[p + "self_attn.k_norm.weight"], eps), ctx_pos, theta),
        rope(rms_norm(heads_of(h, "k_proj", kv_heads), w[p + "self_attn.k_norm.weight"], eps), blk_pos, theta),
    ], axis=1)
    v = np.concatenate([heads_of(ctx, "v_proj", kv_heads), heads_of(h, "v_proj", kv_heads)], axis=1)
    key_pos = np.concatenate([ctx_pos, blk_pos])
    visible = np.zeros((L, n + L), dtype=bool)
    for i in range(L):
        for j, kp in enumerate(key_pos):
            if j < n:
                ok = window is None or kp >= n - window  # the engine's draft window
                visible[i, j] = ok and (not sliding or blk_pos[i] - kp < cfg["sliding_window"])
            else:
                visible[i, j] = not causal or kp <= blk_pos[i]
    out = np.empty((heads, L, hd))
    group = heads // kv_heads
    for head in range(heads):
        scores = q[head] @ k[head // group].T / np.sqrt(hd)
        out[head] = softmax(np.where(visible, scores, -np.inf)) @ v[head // group]
    return out.transpose(1, 0, 2).reshape(L, heads * hd) @ w[p + "self_attn.o_proj.weight"].T


def reference_dflash2(w, cfg, features, block_tokens, embedding, lm_head, window=None):
    """Final hidden states (L, D) and soft-capped logits (L, V) of one draft block."""
    eps, dc = cfg["rms_norm_eps"], cfg["dflash_config"]
    K, gs = dc["conv_kernel_size"], dc["conv_group_size"]
    n, L = features.shape[0], len(block_tokens)
    ctx = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embedding[block_tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."

        def conv(t, name, which, corr, p=p):
            return conv_reference(t, w[p + f"{name}.base_kernel"][which], corr[:, which], gs)

        def corrections(h, name, p=p):
            return (h @ w[p + f"{name}.kernel_projection.weight"].T).reshape(L, 2, K, -1)

        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        c = corrections(h, "attention_conv")
        x = x + conv(attention_reference(w, p, cfg, conv(h, "attention_conv", 0, c), ctx, n, i, window),
                     "attention_conv", 1, c)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        c = corrections(h, "mlp_conv")
        m = conv(h, "mlp_conv", 0, c)
        m = (silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T
        x = x + conv(m, "mlp_conv", 1, c)
    hidden = rms_norm(x, w["norm.weight"], eps)
    logits = hidden @ lm_head.T * dc.get("output_multiplier", 1.0)
    cap = dc.get("final_logit_softcapping")
    return hidden, (np.tanh(logits / cap) * cap if cap else logits)


def selector_reference(w, cfg, hidden, logits, anchor, temperature=0.0, path=None):
    """The walk: chosen tokens, and per position {candidate: q} (sampling, along the given `path`)
    or the score margin of the greedy choice over the runner-up."""
    k = cfg["dflash_config"]["selector_top_k"]
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    pred, succ = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    prev, tokens, info = anchor, [], []
    for t in range(len(hidden)):
        order = np.argsort(-logits[t])
        cands = order[:k]
        boundary = logits[t, order[k - 1]] - logits[t, order[k]]  # top-k membership is clear-cut
        scores = np.array([logits[t, c] + np.sum(pred[prev] * proj[t] * succ[c]) for c in cands])
        if temperature > 0:
            q = softmax(scores / temperature)
            info.append(dict(zip(cands.tolist(), q, strict=True)))
            prev = int(path[t])
        else:
            top2 = np.sort(scores)[-2:]
            info.append(min(top2[1] - top2[0], boundary))
            prev = int(cands[np.argmax(scores)])
        tokens.append(prev)
    return np.array(tokens), info


# ---------------------------------------------------------------- the tests

SW = ["sliding_attention", "full_attention", "sliding_attention"]
CONFIGS = {
    # name: (family, config overrides, committed chunks, draft window, weight seed without near-ties)
    "full-bidirectional-softcap": ("qwen3", dict(softcap=5.0), [30], None, 11),
    "sliding-causal-nocap": ("llama", dict(layer_types=SW, sliding_window=7, softcap=None,
                                           output_multiplier=0.5), [6, 20], None, 12),
    "full-causal-k3": ("qwen2", dict(is_causal=True, kernel_size=3, group_size=8, softcap=4.0), [25], None, 11),
    "sliding-bidirectional-window": ("qwen3", dict(layer_types=["sliding_attention"] * 3, sliding_window=5,
                                                   is_causal=False, softcap=6.0), [12, 12], 9, 11),
}


def drive(name):
    """A drafter fed committed context the way the engine feeds it, the inputs of its next block,
    and the reference's hidden states and logits for that block."""
    family, overrides, chunks, window, seed = CONFIGS[name]
    target_model = tiny_target(family, seed=5)
    target = TargetModel(target_model)
    drafter, cfg = tiny_dflash2(target_model, seed=seed, target_layer_ids=[0, 2, 3], **overrides)
    proposer = dflash_proposer(drafter, target, max_block_size=cfg["block_size"], window=window)
    assert isinstance(proposer, DFlash2Proposer)
    w = numpy_weights(drafter)
    n = sum(chunks)
    features = np.random.default_rng(0).standard_normal((n, 3 * target.hidden_size)).astype(np.float32)
    start = 0
    for size in chunks:
        proposer.commit(mx.array(features[None, start:start + size]), start)
        start += size
    last = 77
    block = [last] + [cfg["dflash_config"]["mask_token_id"]] * (cfg["block_size"] - 1)
    embedding, lm_head = target_head(target_model)
    ref_hidden, ref_logits = reference_dflash2(w, cfg, features.astype(np.float64), block, embedding, lm_head,
                                               window)
    return dict(drafter=drafter, cfg=cfg, proposer=proposer, target=target, w=w, n=n, last=last, block=block,
                ref_hidden=ref_hidden, ref_logits=ref_logits)


def check_greedy_walk(case) -> None:
    """The proposed block equals the reference walk over the reference's own hidden states and logits."""
    tokens, margins = selector_reference(case["w"], case["cfg"], case["ref_hidden"][1:], case["ref_logits"][1:],
                                         case["last"])
    assert min(margins) > 1e-3, "near-tie in the reference walk; pick another seed"
    draft = case["proposer"].propose(mx.array([case["last"]], dtype=mx.uint32), case["n"], case["cfg"]["block_size"])
    np.testing.assert_array_equal(np.array(draft), tokens)


def check_sampled_q(case, seed: int) -> None:
    """Sampling at temperature 0.7: every drafted token is a candidate, and q along the drafted
    path equals the reference's at every position."""
    mx.random.seed(seed)
    draft, proposal = case["proposer"].propose_sampled(mx.array([case["last"]], dtype=mx.uint32), case["n"],
                                                       case["cfg"]["block_size"], 0.7)
    draft, cands, q = np.array(draft), np.array(proposal.candidates), np.array(proposal.q, dtype=np.float64)
    _, ref_q = selector_reference(case["w"], case["cfg"], case["ref_hidden"][1:], case["ref_logits"][1:],
                                  case["last"], temperature=0.7, path=draft)
    for t, expected in enumerate(ref_q):
        assert draft[t] in cands[t]
        assert set(cands[t].tolist()) == set(expected)
        got = dict(zip(cands[t].tolist(), q[t], strict=True))
        np.testing.assert_allclose([got[c] for c in expected], list(expected.values()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_logits_and_walk_match_reference(name):
    case = drive(name)
    drafter, target = case["drafter"], case["target"]
    hidden = drafter(drafter.embed(target, mx.array([case["block"]], dtype=mx.uint32)), case["proposer"].cache,
                     case["n"])
    np.testing.assert_allclose(np.array(hidden[0], dtype=np.float64), case["ref_hidden"], rtol=1e-4, atol=1e-4)
    logits = np.array(drafter.logits(mx.array(case["ref_hidden"][None], dtype=mx.float32), target)[0],
                      dtype=np.float64)
    np.testing.assert_allclose(logits, case["ref_logits"], rtol=1e-4, atol=2e-4)
    cap = case["cfg"]["dflash_config"].get("final_logit_softcapping")
    if cap:  # the cap really binds somewhere, so the test sees the tanh
        raw = case["ref_hidden"] @ target_head(target.model)[1].T
        assert np.abs(raw).max() > cap
        assert np.abs(logits).max() < cap
    check_greedy_walk(case)
    check_sampled_q(case, seed=3)
    assert case["proposer"].cache.offset == case["n"]  # drafting left the committed context as it was


def test_broken_selector_fails_the_reference(monkeypatch):
    """With the edge term dropped the walk is the per-position argmax: the reference tests catch it."""
    case = drive("full-bidirectional-softcap")
    check_greedy_walk(case)
    check_sampled_q(case, seed=3)
    monkeypatch.setattr(selector, "edge_scores", lambda prev, succ: mx.zeros(succ.shape[:2]))
    with pytest.raises(AssertionError):
        check_greedy_walk(case)
    with pytest.raises(AssertionError):
        check_sampled_q(case, seed=3)


@pytest.mark.parametrize("kernel_size, group_size", [(2, 16), (3, 4), (1, 64)])
def test_grouped_dynamic_conv_matches_reference(kernel_size, group_size):
    rng = np.random.default_rng(kernel_size)
    D, L = 64, 8
    conv = GroupedDynamicConv(D, kernel_size, group_size)
    conv.update({"base_kernel": mx.array(rng.standard_normal((2, kernel_size, D)), dtype=mx.float32),
                 "kernel_projection": {"weight": mx.array(rng.standard_normal(conv.kernel_projection.weight.shape)
                                                          / 8, dtype=mx.float32)}})
    x = rng.standard_normal((2, L, D)).astype(np.float32)
    corrections = conv.corrections(mx.array(x))
    assert corrections.shape == (2, L, 2, kernel_size, D // group_size)
    for which in (0, 1):
        out = np.array(conv(mx.array(x), corrections, which))
        for b in range(2):
            expected = conv_reference(x[b].astype(np.float64), np.array(conv.base_kernel[which], dtype=np.float64),
                                      np.array(corrections[b, :, which], dtype=np.float64), group_size)
            np.testing.assert_allclose(out[b], expected, rtol=1e-5, atol=1e-5)
