"""One tree cycle: draft once, build a tree of the likeliest continuations, verify it in one pass.

The acceptance rule is the linear block's, along a branch: from the root, a node is
accepted when its token is the one the target chose (argmax, or its sample) after its
parent; the target's token after the last accepted node is emitted too. Each emitted token
is the target's own choice given exactly the tokens before it, so greedy output equals the
target alone and sampled output follows its distribution (every node's sample is drawn
independently of the tree's other nodes).

After the cycle's one host read (the tree and the target's tokens), the accepted branch's
K/V move to the positions right after the context (`targets.tree.compact`) and only its
target features reach the drafter, so the session then holds what a linear block that
drafted that branch would have left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..proposers.base import DFLASH, Proposer, ScoringProposer, scores_blocks
from ..targets.model import TargetModel
from ..targets.tree import compact, tree_forward, tree_refusal
from .step import Verified
from .tree import SPINE, DraftTree, build_tree, draft_belief, spine_accepted, top_candidates, tree_nodes, walk


def refusal(target: TargetModel, proposer: Proposer | None, sampler: Any = None, constraint: Any = None) -> str | None:
    """Why this session cannot verify trees (None: it can); it then verifies linear blocks."""
    if not scores_blocks(proposer):
        return "trees need a DFlash v1 drafter (DFlash2 drafters and other proposers draft linear blocks)"
    if constraint is not None:
        return "a constrained generation verifies linear blocks"
    return tree_refusal(target)


@dataclass
class LaunchedTree:
    """A tree cycle whose graph is built but not read back yet."""

    tree: DraftTree
    target_tokens: mx.array  # (M + 1,) the target's token after each node, lazily
    features: Any
    logprobs: mx.array  # (M + 1, V)
    position: int  # the root's position
    shape: str
    started: float
    draft_finite: mx.array | None = None

    def finish(self, cache: list[Any], timings: dict[str, float] | None = None) -> Verified:
        """The one host read, the walk, and the compaction of the accepted branch into `cache`."""
        tree = self.tree
        extra = [self.draft_finite] if self.draft_finite is not None else []
        mx.eval(tree.tokens, tree.parents, tree.spine, tree.belief_likelihood, tree.belief_spine, self.target_tokens,
                *extra)
        if timings is not None:
            timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - self.started
        tokens, parents, chosen = tree.tokens.tolist(), tree.parents.tolist(), self.target_tokens.tolist()
        path = walk(tokens, parents, chosen)
        on_spine = tree.spine.tolist()
        spine = spine_accepted(tokens, parents, on_spine, chosen) if self.shape == SPINE else None
        belief = draft_belief(tree.belief_likelihood.tolist(), tree.belief_spine.tolist()) \
            if self.shape == SPINE else None
        compact(cache, self.position, path, len(tokens))
        rows = mx.array(path, dtype=mx.int32)
        emitted = [tokens[i] for i in path[1:]] + [chosen[path[-1]]]
        inputs = mx.array([tokens[i] for i in path], dtype=mx.uint32)
        features = self.features[:, rows] if self.features is not None else None
        finite = None if self.draft_finite is None else bool(self.draft_finite.item())
        return Verified(emitted, len(path) - 1, features, inputs, None, self.logprobs[rows], source=DFLASH,
                        draft_finite=finite, tree_size=tree.size, spine_accepted=spine, draft_belief=belief)


def launch_tree(target: TargetModel, cache: list[Any], proposer: ScoringProposer, sampler: Any, last_token: mx.array,
                position: int, block_size: int, budget: int, shape: str,
                timings: dict[str, float] | None = None, belief_budget: int = 0) -> LaunchedTree:
    """Draft a block of `block_size`, build its tree of `budget` nodes (`shape`), verify it: lazily.
    `belief_budget`: the drafter's belief read back covers the tree of that budget (`build_tree`)."""
    start = time.perf_counter()
    depth = block_size - 1
    nodes, believed = tree_nodes(budget, depth, shape), tree_nodes(max(belief_budget, budget), depth, shape)
    logits = proposer.draft_logits(last_token, position, block_size)
    logprobs, ids = top_candidates(logits, min(believed, logits.shape[-1]))
    tree = build_tree(last_token, logprobs, ids, nodes, shape, believed)
    draft_finite = getattr(proposer, "last_draft_finite", None)
    if timings is not None:
        mx.eval(tree.tokens, tree.visible)
        drafted = time.perf_counter()
        timings["draft"] = timings.get("draft", 0.0) + drafted - start
        start = drafted
    hidden, features = tree_forward(target, tree.tokens, tree.depths, tree.visible, cache, proposer.target_layer_ids)
    logits = target.logits(hidden)[0]
    target_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return LaunchedTree(tree, sampler(target_logprobs), features, target_logprobs, position, shape, start,
                        draft_finite)
