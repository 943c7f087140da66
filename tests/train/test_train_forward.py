"""The training forward equals the inference forward, block by block; anchors and labels are right."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import tiny_drafter, tiny_target
from mlx.utils import tree_flatten

from mlx_dflash.drafters.dflash import DFlashDraftModel
from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.injection import ContextInjector
from mlx_dflash.targets.model import TargetModel
from mlx_dflash.train.anchors import make_batch, sample_anchors
from mlx_dflash.train.data import Example
from mlx_dflash.train.loss import block_labels, decayed_cross_entropy, position_weights
from mlx_dflash.train.model import attention_mask, block_token_ids, draft_blocks

BLOCK = 8


def _inference_logits(drafter: DFlashDraftModel, target: TargetModel, features: mx.array, tokens: mx.array,
                      anchor: int) -> mx.array:
    """The engine's path: context K/V of positions < anchor through the injector, then one draft block."""
    copy = DFlashDraftModel(drafter.args)  # the injector re-points k/v weights; keep the original intact
    copy.load_weights(list(tree_flatten(drafter.parameters())))
    args = drafter.args
    cache = DraftContextCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
                              max_block_size=BLOCK)
    if anchor > 0:
        ContextInjector(copy)(features[:, :anchor], 0, cache)
    block = mx.array([[int(tokens[0, anchor])] + [args.mask_token_id] * (BLOCK - 1)], dtype=mx.uint32)
    hidden = copy(target.embed(block), cache, anchor)
    return target.logits(hidden)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_training_blocks_equal_inference_blocks(model_type):
    model = tiny_target(model_type, seed=3)
    target = TargetModel(model)
    drafter = tiny_drafter(model, seed=4, num_layers=2, block_size=BLOCK)
    T = 40
    tokens = mx.array(np.random.default_rng(0).integers(4, 128, size=(1, T)), dtype=mx.int32)
    _, features = target.forward(tokens, target.make_cache(), drafter.target_layer_ids)
    # Overlapping blocks, a block at position 0 (no context), one running past the end.
    anchors = mx.array([[0, 5, 9, 12, 30, 36]], dtype=mx.int32)
    ids = block_token_ids(tokens, anchors, BLOCK, drafter.mask_token_id)
    hidden = draft_blocks(drafter, target.embed(ids), features, anchors)
    train_logits = target.logits(hidden)
    for j, a in enumerate(anchors[0].tolist()):
        ref = _inference_logits(drafter, target, features, tokens, a)[0]
        assert train_logits.shape[2] == BLOCK
        np.testing.assert_allclose(np.array(train_logits[0, j]), np.array(ref), atol=2e-4, rtol=2e-4)


def test_folded_feature_scale_gives_the_trained_forward_on_raw_features():
    """Training reads features / scale; the folded drafter must compute the same from raw features."""
    from mlx_dflash.train.scaling import feature_scale, fold_feature_scale

    model = tiny_target("qwen3", seed=6)
    target = TargetModel(model)
    drafter = tiny_drafter(model, seed=7, num_layers=2, block_size=BLOCK)
    tokens = mx.array(np.random.default_rng(1).integers(4, 128, size=(1, 32)), dtype=mx.int32)
    _, features = target.forward(tokens, target.make_cache(), drafter.target_layer_ids)
    # Massive, uneven channels as in SmolLM2, and one dead channel (kept at scale 1).
    gains = mx.array(np.random.default_rng(2).uniform(0.1, 3000.0, size=features.shape[-1]), dtype=mx.float32)
    features = (features * gains).at[..., 0].multiply(0.0)
    scale = feature_scale([features[:, :16], features[:, 16:]])
    expected = np.sqrt((np.array(features) ** 2).mean(axis=(0, 1)))
    np.testing.assert_allclose(np.array(scale)[1:], expected[1:], rtol=1e-4)
    assert float(scale[0]) == 1.0
    anchors = mx.array([[3, 11, 20]], dtype=mx.int32)
    embeddings = target.embed(block_token_ids(tokens, anchors, BLOCK, drafter.mask_token_id))
    trained = draft_blocks(drafter, embeddings, features / scale, anchors)
    folded = fold_feature_scale(drafter, scale)
    np.testing.assert_allclose(np.array(draft_blocks(folded, embeddings, features, anchors)), np.array(trained),
                               atol=1e-4, rtol=1e-4)
    # ... and the fold is not a no-op: the unfolded drafter on raw features differs.
    assert not np.allclose(np.array(draft_blocks(drafter, embeddings, features, anchors)), np.array(trained),
                           atol=1e-2)
    for j, a in enumerate(anchors[0].tolist()):
        ref = _inference_logits(folded, target, features, tokens, a)[0]
        np.testing.assert_allclose(np.array(target.logits(trained)[0, j]), np.array(ref), atol=5e-4, rtol=5e-4)


def test_training_forward_is_not_blind_to_context():
    """Changing a context position after an anchor must not move that block; before it must."""
    model = tiny_target("qwen3", seed=5)
    target = TargetModel(model)
    drafter = tiny_drafter(model, seed=6, block_size=BLOCK)
    tokens = mx.array(np.random.default_rng(1).integers(4, 128, size=(1, 30)), dtype=mx.int32)
    _, features = target.forward(tokens, target.make_cache(), drafter.target_layer_ids)
    anchors = mx.array([[10, 20]], dtype=mx.int32)
    ids = block_token_ids(tokens, anchors, BLOCK, drafter.mask_token_id)
    emb = target.embed(ids)
    base = draft_blocks(drafter, emb, features, anchors)
    bumped = features.at[:, 15].add(3.0)  # after anchor 10, before anchor 20
    moved = draft_blocks(drafter, emb, bumped, anchors)
    np.testing.assert_allclose(np.array(moved[0, 0]), np.array(base[0, 0]), atol=1e-6)
    assert float(mx.abs(moved[0, 1] - base[0, 1]).max()) > 1e-3
    own = features.at[:, 10].add(3.0)  # the anchor's own position is not context yet
    np.testing.assert_allclose(np.array(draft_blocks(drafter, emb, own, anchors)[0, 0]), np.array(base[0, 0]),
                               atol=1e-6)


def test_attention_mask_shape_and_pattern():
    mask = np.array(attention_mask(mx.array([[2, 4]]), 6, 3))
    assert mask.shape == (1, 1, 6, 12)
    ctx, blk = mask[0, 0, :, :6], mask[0, 0, :, 6:]
    assert ctx[:3].tolist() == [[True, True, False, False, False, False]] * 3
    assert ctx[3:].tolist() == [[True, True, True, True, False, False]] * 3
    assert blk.tolist() == [[i // 3 == j // 3 for j in range(6)] for i in range(6)]


def test_anchors_lie_where_the_next_token_is_an_assistant_token():
    mask = [False] * 10 + [True] * 20 + [False] * 5 + [True] * 6
    rng = np.random.default_rng(0)
    anchors = sample_anchors(mask, 12, rng)
    assert len(anchors) == 12 and len(set(anchors.tolist())) == 12
    assert all(mask[a + 1] for a in anchors) and list(anchors) == sorted(anchors)
    everything = sample_anchors(mask, 100, rng)  # fewer candidates than asked: all of them
    assert everything.tolist() == [a for a in range(len(mask) - 1) if mask[a + 1]]
    assert sample_anchors([False] * 5, 4, rng).size == 0


def test_batch_padding_and_block_labels():
    rng = np.random.default_rng(0)
    a = Example(list(range(10, 22)), [False] * 4 + [True] * 8)
    b = Example(list(range(30, 36)), [False, False, True, True, True, True])
    batch = make_batch([a, b], 3, rng, pad_id=0)
    assert batch.tokens.shape == (2, 12) and batch.tokens[1, 6:].tolist() == [0] * 6
    assert batch.anchor_valid.sum(axis=1).tolist() == [3, 3]
    anchors = mx.array([[3, 9, 0], [1, 4, 0]])
    valid_anchor = mx.array([[True, True, False], [True, True, False]])
    labels, valid = block_labels(mx.array(batch.tokens), mx.array(batch.loss_mask), anchors, valid_anchor, 4)
    assert labels[0, 0].tolist() == [14, 15, 16]
    assert valid[0, 1].tolist() == [True, True, False]  # positions 10, 11, then past the end
    assert valid[1, 1].tolist() == [True, False, False]  # position 5, then padding
    assert not valid[:, 2].any().item()  # padding anchors never count


def test_decayed_loss_weights_and_value():
    w = position_weights(16)
    assert w.shape == (15,) and abs(w[0].item() - 1.0) < 1e-7 and abs(w[7].item() - np.exp(-1)) < 1e-6
    assert abs(position_weights(8)[4].item() - np.exp(-1)) < 1e-6  # gamma 4 for block 8
    logits = mx.array(np.random.default_rng(0).standard_normal((2, 3, 5)), dtype=mx.float32)
    labels = mx.array([[0, 1, 2], [3, 4, 0]])
    valid = mx.array([[True, True, False], [True, False, False]])
    weights = mx.array([1.0, 0.5, 0.25])
    loss, hits = decayed_cross_entropy(logits, labels, valid, weights)
    lp = np.array(logits) - np.log(np.exp(np.array(logits)).sum(-1, keepdims=True))
    ce = -np.take_along_axis(lp, np.array(labels)[..., None], -1)[..., 0]
    expected = (ce[0, 0] * 1 + ce[0, 1] * 0.5 + ce[1, 0] * 1) / 2.5
    assert abs(loss.item() - expected) < 1e-5
    assert not hits[0, 2].item() and not hits[1, 1].item()
