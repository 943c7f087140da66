"""RaggedKVCache: a batch of sequences of different lengths through mlx-lm's own model classes.

Every batched row is compared with the same sequence decoded alone on mlx-lm's KVCache
(trimmed for the rejected positions). On the CPU a batched matmul may round differently
from a single-row one, so logits are compared within a float32 tolerance, with identical
argmax at every position; K/V merely moved between caches must be bitwise equal.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlx_dflash.batching.target_cache import RaggedKVCache, batch_rows, unbatch_row
from mlx_dflash.errors import DFlashError
from mlx_dflash.targets.model import TargetModel

ATTENTION_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
TOL = 1e-4
L = 4
MAX_DIFF: dict[str, float] = {}  # family -> the largest |batched - alone| logit gap seen


def _tokens(rng: np.random.Generator, *shape: int) -> mx.array:
    return mx.array(rng.integers(4, 128, size=shape), dtype=mx.uint32)


def _prefill(model, prompt: mx.array) -> list[KVCache]:
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[None], cache=cache))
    return cache


def _close(family: str, batched: mx.array, alone: mx.array) -> None:
    """Same argmax everywhere and a gap under TOL; records the gap for the report."""
    gap = mx.abs(batched - alone).max().item()
    MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), gap)
    assert gap < TOL, gap
    assert mx.array_equal(batched.argmax(-1), alone.argmax(-1)).item()


def _verify_steps(family: str, model, batch: list[RaggedKVCache], alone: dict[int, list[KVCache]],
                  rng: np.random.Generator, steps: int) -> None:
    """`steps` verify blocks of L for every row in one forward, each row keeping 1..L; rows in
    `alone` (row index -> its own cache) are checked against the sequence decoded alone."""
    B = batch[0].batch_size
    for _ in range(steps):
        block = _tokens(rng, B, L)
        logits = model(block, cache=batch)
        kept = [int(k) for k in rng.integers(1, L + 1, size=B)]
        for i, cache in alone.items():
            _close(family, logits[i], model(block[i : i + 1], cache=cache)[0])
            for c in cache:
                c.trim(L - kept[i])
        for c in batch:
            c.advance(kept)


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_ragged_verify_matches_each_row_alone(family: str, targets) -> None:
    model = targets(family)
    rng = np.random.default_rng(0)
    prompts = [_tokens(rng, n) for n in (7, 2, 12)]
    batch = batch_rows([_prefill(model, p) for p in prompts])
    alone = {i: _prefill(model, p) for i, p in enumerate(prompts)}
    assert batch[0].lengths == [7, 2, 12]
    _verify_steps(family, model, batch, alone, rng, steps=6)
    for i, cache in alone.items():  # the committed lengths followed each row's own acceptance
        assert batch[0].lengths[i] == cache[0].offset


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_forward_runs_on_ragged_cache(family: str, targets) -> None:
    """The project's own forward (capturing layers) builds its masks through the ragged cache too."""
    model = targets(family)
    target, rng = TargetModel(model), np.random.default_rng(1)
    prompts = [_tokens(rng, n) for n in (3, 9)]
    batch = batch_rows([_prefill(model, p) for p in prompts])
    block = _tokens(rng, 2, L)
    hidden, features = target.forward(block, batch, capture=[1, 2])
    for i, p in enumerate(prompts):
        h, f = target.forward(block[i : i + 1], _prefill(model, p), capture=[1, 2])
        _close(family, target.logits(hidden[i]), target.logits(h[0]))
        assert mx.abs(features[i] - f[0]).max().item() < TOL


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_row_leaves_and_continues_alone(family: str, targets) -> None:
    model = targets(family)
    rng = np.random.default_rng(2)
    prompts = [_tokens(rng, n) for n in (5, 10, 3)]
    rows = [_prefill(model, p) for p in prompts]
    batch = batch_rows(rows)
    for i, row in enumerate(rows):  # merging and extracting moves K/V bitwise
        out = unbatch_row(batch, i)
        for a, b in zip(out, row, strict=True):
            assert a.offset == b.offset and mx.array_equal(a.keys, b.keys[..., : b.offset, :]).item()
    alone = {i: _prefill(model, p) for i, p in enumerate(prompts)}
    _verify_steps(family, model, batch, alone, rng, steps=3)
    left = unbatch_row(batch, 1)  # row 1 leaves; it and its reference go on alone
    for _ in range(4):
        block = _tokens(rng, 1, L)
        _close(family, model(block, cache=left), model(block, cache=alone[1]))
        for c in left + alone[1]:
            c.trim(1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_empty_row_and_filter_keep_others_exact(family: str, targets) -> None:
    model = targets(family)
    rng = np.random.default_rng(3)
    prompts = {0: _tokens(rng, 6), 2: _tokens(rng, 11), 3: _tokens(rng, 1)}
    rows = [_prefill(model, prompts[0]), make_prompt_cache(model), _prefill(model, prompts[2]),
            _prefill(model, prompts[3])]
    batch = batch_rows(rows)  # row 1: an empty slot (length 0), fed tokens like any other row
    assert batch[0].lengths == [6, 0, 11, 1]
    alone = {i: _prefill(model, p) for i, p in prompts.items()}
    _verify_steps(family, model, batch, alone, rng, steps=3)
    for c in batch:  # rows 1 and 3 leave
        c.filter([0, 2])
    _verify_steps(family, model, batch, {0: alone[0], 1: alone[2]}, rng, steps=3)
    new = _tokens(rng, 4)  # a new sequence joins after its own prefill
    for c, joined in zip(batch, batch_rows([_prefill(model, new)]), strict=True):
        c.extend(joined)
    _verify_steps(family, model, batch, {0: alone[0], 1: alone[2], 2: _prefill(model, new)}, rng, steps=3)


def test_mask_and_offset() -> None:
    cache = RaggedKVCache([0, 2, 5])
    assert cache.offset.tolist() == [0, 2, 5]
    mask = cache.make_mask(3)
    assert mask.shape == (3, 1, 3, 8) and mask.dtype == mx.bool_
    expect = np.array([[[p < n + j + 1 for p in range(8)] for j in range(3)] for n in (0, 2, 5)])
    assert (np.array(mask[:, 0]) == expect).all()


def test_commit_rules_and_refusals() -> None:
    cache = RaggedKVCache.from_caches([None, KVCache()])
    assert cache.lengths == [0, 0] and cache.empty()
    k = mx.ones((2, 2, L, 8))
    cache.update_and_fetch(k, k)
    with pytest.raises(DFlashError, match="not committed"):
        cache.update_and_fetch(k, k)
    with pytest.raises(DFlashError, match="within 0..4"):
        cache.advance([1, 5])
    cache.advance([1, 3])
    assert cache.lengths == [1, 3] and cache.offset.tolist() == [1, 3]
    with pytest.raises(DFlashError, match="never wrote"):
        cache.set_lengths([2, 3])
    cache.set_lengths([0, 2])  # a rollback into committed history
    assert cache.row(1).offset == 2 and cache.row(0).keys is None
    mx.eval(cache.state)
    for bad in (QuantizedKVCache(), RotatingKVCache(max_size=8)):
        with pytest.raises(DFlashError, match=type(bad).__name__):
            RaggedKVCache.from_caches([KVCache(), bad])
    with pytest.raises(DFlashError, match="sliding-window"):
        cache.make_mask(2, window_size=4)


def test_report_max_diff() -> None:
    """Runs last in this file: the largest logit gaps seen per family (shown with -s)."""
    for family, gap in sorted(MAX_DIFF.items()):
        print(f"ragged vs alone, {family}: max |logit diff| = {gap:.3g}")
