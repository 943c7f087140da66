"""The drafter's numerics against an independent numpy reference of the method.

The reference is written from the description of one decoding cycle (doc
section 1, steps 2-4), not from our code: context features
`hidden_norm(fc(concat))`; a block `[last token, MASK, ...]` embedded with the
target's table; per Qwen3 draft layer queries from the block only
(`q_norm(q_proj(x))`, RoPE), keys/values from the context features and from the
block (`k_norm(k_proj(.))`, `v_proj(.)`, RoPE on both key sets at absolute
positions), GQA, non-causal attention over [context; block], residual,
post-attention RMSNorm, SwiGLU MLP, residual; final norm; the target's lm_head.
It uses only numpy and the weights (read out as numpy arrays); no mlx_dflash
function is called inside it. The drafter is driven the way the engine drives
it: context committed through `DFlashProposer.commit`, then `propose` and the
draft layers' hidden states at the block position.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.numpy_reference import numpy_weights, reference_draft, target_head
from helpers.tiny import drafter_config, tiny_target
from mlx.utils import tree_flatten

from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel

# ---------------------------------------------------------------- the reference


# ---------------------------------------------------------------- the tests


def make_drafter(target_model, *, head_dim, num_layers, seed, mask_token_id=3, target_layer_ids=None,
                 sliding=None):
    cfg = drafter_config(target_model, num_layers=num_layers, block_size=8, mask_token_id=mask_token_id,
                         target_layer_ids=target_layer_ids)
    cfg.update(head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0)
    if sliding is not None:  # (layer_types, sliding_window) as in sliding-window drafter configs
        cfg.update(layer_types=sliding[0], sliding_window=sliding[1])
    drafter = DFlashDraftModel(ModelArgs.from_dict(cfg))
    rng = np.random.default_rng(seed)
    params = [
        (k, mx.array((1 + 0.1 * rng.standard_normal(v.shape)) if v.ndim == 1
                     else rng.standard_normal(v.shape) / np.sqrt(v.shape[-1]), dtype=mx.float32))
        for k, v in tree_flatten(drafter.parameters())
    ]
    drafter.load_weights(params)
    mx.eval(drafter.parameters())
    return drafter, cfg


SLIDING = (["sliding_attention", "full_attention", "sliding_attention"], 9)


@pytest.mark.parametrize(
    "family, head_dim, chunks, window, sliding",
    [
        ("qwen3", 16, [37], None, None),  # tied embedding as lm_head, head_dim == hidden / heads
        ("llama", 24, [5, 1, 30], None, None),  # separate lm_head, head_dim != hidden / heads; 3 commits
        ("qwen2", 16, [20, 20], 12, None),  # a draft window: only the last 12 context positions
        ("qwen3", 16, [30], None, SLIDING),  # sliding-attention draft layers see their last 9
        ("llama", 16, [8, 25], 14, SLIDING),  # both: the tighter limit wins per layer
    ],
)
def test_drafter_matches_numpy_reference(family, head_dim, chunks, window, sliding):
    target_model = tiny_target(family, seed=5)
    target = TargetModel(target_model)
    drafter, cfg = make_drafter(target_model, head_dim=head_dim, num_layers=3, seed=11,
                                target_layer_ids=[0, 2, 3], sliding=sliding)
    block_size = cfg["block_size"]
    proposer = DFlashProposer(drafter, target, max_block_size=block_size, window=window)
    weights = numpy_weights(drafter)  # read before the proposer could have touched anything
    embedding, lm_head = target_head(target_model)

    n = sum(chunks)
    rng = np.random.default_rng(0)
    features = rng.standard_normal((n, 3 * target.hidden_size)).astype(np.float32)
    start = 0
    for size in chunks:  # committed in pieces, each at its absolute position
        proposer.commit(mx.array(features[None, start : start + size]), start)
        start += size
    assert proposer.cache.offset == n

    last = 77
    block = [last] + [cfg["dflash_config"]["mask_token_id"]] * (block_size - 1)
    ref_hidden, ref_logits = reference_draft(weights, cfg, features.astype(np.float64), block, embedding,
                                             lm_head, context_window=window)

    hidden = drafter(target.embed(mx.array([block], dtype=mx.uint32)), proposer.cache, n)
    hidden = np.array(hidden[0], dtype=np.float64)
    np.testing.assert_allclose(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    logits = np.array(target.logits(mx.array(hidden[None], dtype=mx.float32))[0], dtype=np.float64)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=2e-4)

    # propose: the argmax at block positions 1..B-1 (where the reference's top two are not a near-tie).
    draft = np.array(proposer.propose(mx.array([last], dtype=mx.uint32), n, block_size))
    assert draft.shape == (block_size - 1,)
    top2 = np.sort(ref_logits[1:], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.sum() >= block_size // 2
    np.testing.assert_array_equal(draft[clear], ref_logits[1:].argmax(axis=-1)[clear])
    # Drafting left the committed context as it was.
    assert proposer.cache.offset == n


def test_features_are_the_outputs_of_the_selected_layers():
    """The captured features are HF `hidden_states[i + 1]`: decoder layer i's raw output.

    Checked against mlx-lm's own forward: a copy of the model truncated to i + 1 layers,
    with the final norm replaced by the identity, returns layer i's output as its hidden state.
    """
    import copy

    import mlx.nn as nn

    model = tiny_target("qwen3", seed=8)
    target = TargetModel(model)
    tokens = mx.array([[4, 50, 9, 100, 23, 7]], dtype=mx.uint32)
    hidden, features = target.forward(tokens, target.make_cache(), capture=[3, 0, 2])
    np.testing.assert_allclose(np.array(target.logits(hidden)), np.array(model(tokens)), rtol=1e-5, atol=1e-5)
    per_layer = np.split(np.array(features[0]), 3, axis=-1)
    for slot, layer in enumerate([3, 0, 2]):
        truncated = copy.copy(model.model)
        truncated.layers = model.model.layers[: layer + 1]
        truncated.norm = nn.Identity()
        np.testing.assert_allclose(per_layer[slot], np.array(truncated(tokens)[0]), rtol=1e-5, atol=1e-5)
