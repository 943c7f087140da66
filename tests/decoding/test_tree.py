"""Draft trees: their shape against a plain best-first search, and decoding through them staying exact.

Greedy output through trees must equal the target alone on every family that verifies trees, with
branches off the spine accepted (`RankOracle` puts the right token at rank 1 or 2 often); sampled
output must follow the target's distribution; targets and drafters that cannot verify trees say why
and decode linear blocks.
"""

from __future__ import annotations

import heapq

import mlx.core as mx
import numpy as np
import pytest
from helpers.distributions import P_BROKEN, pit_pvalue
from helpers.families import build
from helpers.tiny import VOCAB, _randomize, greedy_reference, target_config, tiny_drafter, tiny_target
from helpers.tree_oracles import LogitOracle, RankOracle, decode_cycles
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.utils import _get_classes

from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.decoding.tree import PAPER, SPINE, build_tree, top_candidates, tree_nodes, walk
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.targets.model import TargetModel
from mlx_dflash.targets.tree import compact, tree_forward, tree_refusal

TREE_FAMILIES = ["qwen3", "qwen3_moe", "llama", "mistral", "qwen2"]
PROMPT = [5, 17, 33, 90, 41, 12, 7, 64, 100, 23, 51]
P_HONEST = 1e-4


def best_first(logprobs: np.ndarray, nodes: int, spine: bool) -> set[tuple[int, ...]]:
    """Rank paths of the tree a best-first search builds (the spine's nodes first when `spine`)."""
    depth, k = logprobs.shape

    def key(ranks: tuple[int, ...]) -> float:
        forced = spine and not any(ranks)
        return -np.inf if forced else -sum(logprobs[d, r] for d, r in enumerate(ranks))

    heap, out = [(key((0,)), (0,))], set()
    while heap and len(out) < nodes:
        _, ranks = heapq.heappop(heap)
        out.add(ranks)
        if ranks[-1] + 1 < k:
            sibling = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (key(sibling), sibling))
        if len(ranks) < depth:
            child = ranks + (0,)
            heapq.heappush(heap, (key(child), child))
    return out


def token_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, len(tokens)):
        paths[i] = paths[parents[i]] + (tokens[i],)
    return set(paths.values()) - {()}


@pytest.mark.parametrize("shape", [PAPER, SPINE])
@pytest.mark.parametrize("depth,budget", [(7, 1), (7, 4), (7, 16), (15, 32), (15, 64), (3, 64)])
def test_the_tree_is_the_best_first_search_s(shape, depth, budget):
    rng = np.random.default_rng([depth, budget])
    logits = mx.array((rng.normal(size=(depth, 32)) * rng.uniform(0.5, 4, size=(depth, 1))).astype(np.float32))
    nodes = tree_nodes(budget, depth, shape)
    logprobs, ids = top_candidates(logits, min(nodes, 32))
    tree = build_tree(mx.array([3], dtype=mx.uint32), logprobs, ids, nodes, shape)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    ids_np = np.array(ids)
    expected = {tuple(int(ids_np[d, r]) for d, r in enumerate(p))
                for p in best_first(np.array(logprobs), nodes, shape == SPINE)}
    assert token_paths(tokens, parents) == expected
    assert tokens[0] == 3 and tree.size == min(nodes, len(expected))
    assert all(parents[i] < i for i in range(1, len(tokens)))  # parents first
    if shape == SPINE:  # the linear draft is in it
        argmax = np.argmax(np.array(logits), axis=-1).tolist()
        assert all(tuple(argmax[: d + 1]) in expected for d in range(depth))
    # Each node sees exactly its ancestors and itself, at the position of its depth.
    visible, depths = np.array(tree.visible), tree.depths.tolist()
    for i in range(len(tokens)):
        chain, j = {i}, i
        while j:
            j = parents[j]
            chain.add(j)
        assert set(np.flatnonzero(visible[i]).tolist()) == chain
        assert depths[i] == len(chain) - 1


def test_walk_follows_the_targets_choices():
    tokens, parents = [9, 4, 5, 6, 7], [0, 0, 0, 1, 3]  # 0 -> {4, 5}; 4 -> 6 -> 7
    assert walk(tokens, parents, [4, 6, 0, 7, 1]) == [0, 1, 3, 4]
    assert walk(tokens, parents, [5, 6, 0, 7, 1]) == [0, 2]
    assert walk(tokens, parents, [8, 6, 0, 7, 1]) == [0]


def run(target, proposer, prompt, max_tokens, policy, sampler=None):
    """Decode through `session.cycle` with `policy`: (output tokens, per drafting cycle (tree size, accepted))."""
    session, cycles = decode_cycles(target, proposer, prompt, max_tokens, policy, sampler)
    return session.tokens[len(prompt):], [(v.tree_size, v.num_accepted) for size, v in cycles if size > 1]


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_greedy_through_trees_equals_the_target_alone(family):
    model = tiny_target(family, seed=4)
    target = TargetModel(model)
    assert tree_refusal(target) is None
    reference = greedy_reference(model, PROMPT, 40)[:40]
    taus = {}
    for budget, shape in [(0, SPINE), (12, SPINE), (24, PAPER), (5, PAPER)]:
        policy = FixedBlockSize(8, tree_budget=budget, tree_shape=shape)
        out, cycles = run(target, RankOracle(model, VOCAB, seed=2), PROMPT, 40, policy)
        assert out == reference, (budget, shape)
        assert all((size is None) == (budget == 0) for size, _ in cycles)
        taus[budget, shape] = sum(a + 1 for _, a in cycles) / len(cycles)
    assert taus[12, SPINE] > taus[0, SPINE]  # branches off the spine were accepted
    assert taus[24, PAPER] > taus[0, SPINE]


def test_trees_with_a_real_drafter_leave_its_context_as_a_linear_run_would():
    """The drafter's context after tree cycles holds exactly the committed positions' features."""
    model = tiny_target("qwen3", seed=4)
    target = TargetModel(model)
    drafter = tiny_drafter(model, block_size=8)
    reference = greedy_reference(model, PROMPT, 24)[:24]
    session = DecodingSession(target, make_proposer(target, drafter, 8), defer_injection=False)
    sampler = make_sampler(0.0)
    session.extend(PROMPT, sampler)
    policy = FixedBlockSize(8, tree_budget=32, tree_shape=PAPER)
    while len(session.tokens) < len(PROMPT) + 24:
        session.cycle(sampler, policy, len(PROMPT) + 24 - len(session.tokens), set())
    assert session.tokens[len(PROMPT):] == reference
    fresh = DecodingSession(target, make_proposer(target, drafter, 8))
    fresh.extend(session.tokens[:-1], sampler)  # the same committed tokens, fed linearly
    for ours, theirs in zip(session.proposer.state_arrays(), fresh.proposer.state_arrays(), strict=True):
        assert ours.shape == theirs.shape
        assert mx.allclose(ours, theirs, atol=1e-4).item()
    for ours, theirs in zip(session.cache, fresh.cache, strict=True):
        assert ours.offset == theirs.offset
        assert mx.allclose(ours.keys[..., : ours.offset, :], theirs.keys[..., : theirs.offset, :], atol=1e-4).item()


def test_compaction_keeps_the_branch_of_a_quantized_cache():
    config = dict(target_config("qwen3"), head_dim=32)  # quantized K/V takes groups of 32 or more
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize(model, 4, scale=2.0)
    target = TargetModel(model)

    def quantized():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.model.layers]

    tokens = mx.array([9, 4, 5, 6, 7], dtype=mx.uint32)  # 0 -> {4, 5}; 4 -> 6 -> 7
    parents = [0, 0, 0, 1, 3]
    visible = mx.array([[j in {i, *_ancestors(parents, i)} for j in range(5)] for i in range(5)])
    cache = quantized()
    target.forward(mx.array([PROMPT]), cache)
    tree_forward(target, tokens, mx.array([0, 1, 1, 2, 3]), visible, cache)
    compact(cache, len(PROMPT), [0, 1, 3, 4], 5)
    plain = quantized()
    target.forward(mx.array([PROMPT + [9, 4, 6, 7]]), plain)
    for ours, theirs in zip(cache, plain, strict=True):
        assert ours.offset == theirs.offset == len(PROMPT) + 4
        for a, b in [(ours.keys, theirs.keys), (ours.values, theirs.values)]:
            a, b = (mx.dequantize(*(x[..., : ours.offset, :] for x in q), group_size=32, bits=8) for q in (a, b))
            assert mx.abs(a - b).max().item() < 0.05 * mx.abs(b).max().item()  # a quantization step or two


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while i:
        i = parents[i]
        out.append(i)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3_text", "gpt_oss"])
def test_targets_that_cannot_drop_branches_refuse_trees_and_decode_linear_blocks(model_type):
    model = build(model_type, seed=3)
    target = TargetModel(model)
    reason = tree_refusal(target)
    assert reason is not None and ("recurrent" in reason or "linear blocks only" in reason), reason
    out, cycles = run(target, RankOracle(model, VOCAB, seed=2), PROMPT, 16, FixedBlockSize(4, tree_budget=16))
    assert out == greedy_reference(model, PROMPT, 16)[:16]
    assert all(size is None for size, _ in cycles)


def test_dflash2_drafters_and_grammars_refuse_trees():
    from helpers.tiny_dflash2 import tiny_dflash2

    from mlx_dflash.decoding.tree_step import refusal

    model = tiny_target("qwen3", seed=4)
    target = TargetModel(model)
    assert "DFlash v1" in refusal(target, make_proposer(target, tiny_dflash2(model)[0], 4))
    assert "DFlash v1" in refusal(target, None)
    assert "constrained" in refusal(target, make_proposer(target, tiny_drafter(model), 4), constraint=object())
    assert refusal(target, make_proposer(target, tiny_drafter(model), 4)) is None


@pytest.mark.slow
def test_sampled_tokens_through_trees_follow_the_target():
    model = tiny_target("qwen3", seed=5)
    target = TargetModel(model)
    mx.random.seed(11)
    outputs, accepted, cycles = [], 0, 0
    for _ in range(40):
        sampler = make_sampler(1.0, top_k=6)
        out, run_cycles = run(target, LogitOracle(model, VOCAB), PROMPT, 20, FixedBlockSize(6, tree_budget=16), sampler)
        outputs.append(out[:20])
        accepted += sum(a for _, a in run_cycles)
        cycles += len(run_cycles)
    p = pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, temp=1.0, top_k=6)
    assert p > P_HONEST, p
    assert accepted / cycles > 0.5  # the trees' branches were accepted often
    assert pit_pvalue(model, [PROMPT] * len(outputs), outputs, seed=1, temp=1.0) < P_BROKEN
