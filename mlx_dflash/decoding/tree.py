"""Draft trees (DDTree): the likeliest continuations of one draft pass, verified in one target pass.

The drafter scores every token at each of the block's D positions in one pass; the linear
draft keeps each position's argmax. A tree keeps more: from each position's top-k
log-probabilities it takes M nodes, a node being a path of ranks whose likelihood under the
drafter is the product of its tokens' probabilities. Two shapes:

- "paper": the M likeliest nodes (what the paper's best-first search pops first);
- "spine" (the default): the linear draft, the argmax path to depth D, always, then the
  likeliest others up to max(M, D) nodes. It holds the linear block's draft, so it never
  accepts fewer tokens than the linear block of D + 1.

The tree is built on the device, lazily, inside the cycle's graph (no host read): per depth,
the best extensions of the previous depth's best (a node among the M best overall is among
the M best of its depth, and so is its parent), then the best M of all depths, ties going
to the shallower node so that the set holds every node's parent. The cycle's one host read
returns the tree with the target's tokens; `walk` then follows the target's choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

SPINE, PAPER = "spine", "paper"
SHAPES = (SPINE, PAPER)


@dataclass
class DraftTree:
    """A draft tree as verify inputs: the pending token (the root), then M nodes, parents first."""

    tokens: mx.array  # (M + 1,) uint32
    parents: mx.array  # (M + 1,) int32: each node's parent (the root's: 0)
    depths: mx.array  # (M + 1,) int32: 0 for the root
    visible: mx.array  # (M + 1, M + 1) bool: node i sees node j (j is i or its ancestor)
    spine: mx.array  # (M + 1,) bool: the root and the argmax path (the linear draft's nodes)
    # The drafter's belief: log-probability under the drafter of each node (its path's) of the tree of
    # `belief_nodes` nodes (this one's nodes, or a larger tree's), and which of them are on the spine.
    belief_likelihood: mx.array
    belief_spine: mx.array

    @property
    def size(self) -> int:
        return self.tokens.shape[0] - 1


def tree_nodes(budget: int, depth: int, shape: str) -> int:
    """How many nodes a tree of `budget` has with drafts `depth` deep."""
    return max(budget, depth) if shape == SPINE else budget


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Each row's `k` likeliest tokens, best first: (log-probabilities, token ids), both (D, k)."""
    logits = logits.astype(mx.float32)
    log_z = mx.logsumexp(logits, axis=-1, keepdims=True)
    if k < logits.shape[-1]:
        ids = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
    else:
        ids = mx.broadcast_to(mx.arange(logits.shape[-1]), logits.shape)
    values = mx.take_along_axis(logits, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1) - log_z, mx.take_along_axis(ids, order, axis=-1)


def _best(keys: mx.array, width: int) -> mx.array:
    """Indices of `width` of the largest `keys` (any order)."""
    if width >= keys.shape[0]:
        return mx.arange(keys.shape[0])
    return mx.argpartition(-keys, width - 1)[:width]


def _picked(keys: mx.array, nodes: int) -> mx.array:
    """Table indices, ascending, of the `nodes` largest keys; among keys equal to the last one taken,
    the first in table order (shallower first), so that every chosen node's parent is chosen too."""
    table = keys.shape[0]
    threshold = -mx.partition(-keys, nodes - 1)[nodes - 1]
    above, tied = keys > threshold, keys == threshold
    chosen = above | (tied & (mx.cumsum(tied.astype(mx.int32)) <= nodes - above.sum()))
    index = mx.arange(table, dtype=mx.int32)
    return mx.argsort(mx.where(chosen, index, index + table))[:nodes]


def build_tree(root: mx.array, logprobs: mx.array, ids: mx.array, nodes: int, shape: str = SPINE,
               belief_nodes: int = 0) -> DraftTree:
    """The tree of `nodes` nodes (`tree_nodes`) over `top_candidates`' output, after `root` (1,).

    `belief_nodes` (>= nodes): the drafter's belief (`DraftTree.belief_*`) covers the tree of that
    many nodes, so that what a larger budget would add is known too (`top_candidates` must then
    have given at least that many candidates per position, or the vocabulary)."""
    depth, k = logprobs.shape
    width = max(nodes, belief_nodes)
    spine_ranks = mx.arange(k) == 0
    # Level 1: the root's children. A key is a node's log-likelihood, +inf on the spine.
    scores, on_spine = logprobs[0], spine_ranks
    tokens, parents = ids[0], mx.zeros((k,), dtype=mx.int32)
    levels_keys, levels_tokens, levels_parents, levels_spine, levels_scores = [], [], [], [], []
    first = 1  # table index of this level's first node (the root is 0)
    for d in range(depth):
        if d:
            count = scores.shape[0]
            scores = (scores[:, None] + logprobs[d][None, :]).reshape(-1)
            on_spine = (on_spine[:, None] & spine_ranks[None, :]).reshape(-1)
            tokens = mx.broadcast_to(ids[d][None, :], (count, k)).reshape(-1)
            parents = mx.broadcast_to((first + mx.arange(count, dtype=mx.int32))[:, None], (count, k)).reshape(-1)
            first += count
        keys = mx.where(on_spine, mx.inf, scores) if shape == SPINE else scores
        keep = _best(keys, width)
        scores, on_spine, tokens, parents = scores[keep], on_spine[keep], tokens[keep], parents[keep]
        levels_keys.append(keys[keep])
        levels_spine.append(on_spine)
        levels_scores.append(scores)
        levels_tokens.append(tokens)
        levels_parents.append(parents)
    keys = mx.concatenate(levels_keys)
    table = keys.shape[0]
    nodes = min(nodes, table)
    picked = _picked(keys, nodes)
    # Table index (1-based; the root 0) -> tree index.
    tree_index = mx.zeros((table + 1,), dtype=mx.int32).at[picked + 1].add(mx.arange(1, nodes + 1, dtype=mx.int32))
    node_parents = tree_index[mx.concatenate(levels_parents)[picked]]
    all_parents = mx.concatenate([mx.zeros((1,), dtype=mx.int32), node_parents])
    all_tokens = mx.concatenate([root.astype(mx.uint32), mx.concatenate(levels_tokens)[picked].astype(mx.uint32)])
    visible = ancestry(all_parents, depth)
    depths = visible.sum(axis=1).astype(mx.int32) - 1
    all_spine, all_scores = mx.concatenate(levels_spine), mx.concatenate(levels_scores)
    spine = mx.concatenate([mx.array([True]), all_spine[picked]])
    believed = _picked(keys, min(belief_nodes, table)) if belief_nodes > nodes else picked
    return DraftTree(all_tokens, all_parents, depths, visible, spine, all_scores[believed], all_spine[believed])


def ancestry(parents: mx.array, depth: int) -> mx.array:
    """(N, N) bool: j is i or one of its ancestors, for trees at most `depth` deep (root 0)."""
    n = parents.shape[0]
    step = (mx.arange(n)[None, :] == parents[:, None]) & (mx.arange(n) > 0)[:, None]
    reach = (mx.eye(n) + step.astype(mx.float32)) > 0
    for _ in range(max(math.ceil(math.log2(depth + 1)), 0)):  # paths of 1, 2, 4, ... steps
        reach = (reach.astype(mx.float32) @ reach.astype(mx.float32)) > 0
    return reach


@dataclass
class DraftBelief:
    """What the drafter expected of a tree it drafted: each node is accepted with its path's probability
    under the drafter, so the expected accepted nodes are the sum of those probabilities."""

    spine: float  # expected accepted nodes of the linear draft (the spine)
    others: list[float]  # the other nodes' probabilities, largest first

    def expected(self, nodes: int, depth: int) -> float:
        """Expected accepted nodes of the spine tree of `nodes` nodes (`nodes` <= depth: the linear draft)."""
        return self.spine + sum(self.others[: max(nodes - depth, 0)])


def draft_belief(likelihood: list[float], spine: list[bool]) -> DraftBelief:
    """The belief read off `DraftTree.belief_likelihood` and `belief_spine`."""
    probs, on_spine = [math.exp(x) for x in likelihood], spine
    return DraftBelief(sum(p for p, s in zip(probs, on_spine, strict=True) if s),
                       sorted((p for p, s in zip(probs, on_spine, strict=True) if not s), reverse=True))


def spine_accepted(tokens: list[int], parents: list[int], spine: list[bool], chosen: list[int]) -> int:
    """How many tokens of the linear draft (the spine) the target accepted: what the linear block would have."""
    following = {parents[i]: i for i in range(1, len(tokens)) if spine[i]}
    node, count = 0, 0
    while node in following and tokens[following[node]] == chosen[node]:
        node, count = following[node], count + 1
    return count


def walk(tokens: list[int], parents: list[int], chosen: list[int]) -> list[int]:
    """The accepted branch: from the root, the child whose token is the target's choice at
    its parent (`chosen[i]`: the target's token after node i), while there is one. Returns
    the branch's node indices, the root first."""
    children = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    path = [0]
    while (path[-1], chosen[path[-1]]) in children:
        path.append(children[(path[-1], chosen[path[-1]])])
    return path
