"""Draft trees of shape "paper" match the DDTree paper's own code, tree for tree and walk for walk.

`ddtree_reference.json` holds rounds run through the reference implementation of the DDTree paper
(github.com/liranringel/ddtree); `ddtree_reference.py`, next to this file, wrote it and says how to
write it again. Each round gives draft logits, a budget, a true continuation that decides the
target's tokens, and what the reference did with them: the tree (its nodes' token paths) and the
accepted length (root included). Here `top_candidates` + `build_tree(..., shape="paper")` with
`nodes = budget` must build the same set of nodes, and `walk` along the same target tokens must
accept as many.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_dflash.decoding.tree import PAPER, build_tree, top_candidates, walk

FIXTURE = Path(__file__).with_name("ddtree_reference.json")
DEPTHS = (7, 15)
BUDGETS = (4, 8, 16, 32, 64)


@cache
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def target_choice(path: tuple[int, ...], continuation: list[int], vocab: int) -> int:
    """The target's token after the node whose tokens (root excluded) are `path`: the fixture's rule."""
    d = len(path)
    if list(path) == continuation[:d]:
        return continuation[d]
    return (7 * sum(path) + 3 * d + 1) % vocab


def our_round(logits: np.ndarray, budget: int, continuation: list[int], vocab: int):
    """Our tree's node paths (root excluded) and the accepted length of its walk (root included)."""
    logprobs, ids = top_candidates(mx.array(logits), min(budget, vocab))
    tree = build_tree(mx.array([0], dtype=mx.uint32), logprobs, ids, nodes=budget, shape=PAPER)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths: dict[int, tuple[int, ...]] = {0: ()}

    def path_of(i: int) -> tuple[int, ...]:
        if i not in paths:
            paths[i] = path_of(parents[i]) + (tokens[i],)
        return paths[i]

    node_paths = [path_of(i) for i in range(len(tokens))]
    chosen = [target_choice(p, continuation, vocab) for p in node_paths]
    return node_paths[1:], len(walk(tokens, parents, chosen))


def test_fixture_covers_every_case():
    data = fixture()
    assert data["vocab"] == 32
    cases = {(r["depth"], r["budget"]) for r in data["rounds"]}
    assert cases == {(d, b) for d in DEPTHS for b in BUDGETS}
    for depth, budget in cases:
        rounds = [r for r in data["rounds"] if (r["depth"], r["budget"]) == (depth, budget)]
        assert len(rounds) >= 3
        for r in rounds:
            assert np.array(r["logits"]).shape == (depth, data["vocab"])
            assert len(r["continuation"]) == depth + 1
            assert len(r["tree"]) == budget
    for depth in DEPTHS:  # some trees run to the draft's last position, and some walks accept it all
        rounds = [r for r in data["rounds"] if r["depth"] == depth]
        assert any(max(map(len, r["tree"])) == depth for r in rounds)
    assert any(r["accepted"] == r["depth"] + 1 for r in data["rounds"])


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_paper_tree_matches_reference(depth, budget):
    data = fixture()
    vocab = data["vocab"]
    rounds = [r for r in data["rounds"] if (r["depth"], r["budget"]) == (depth, budget)]
    assert rounds
    for r in rounds:
        logits = np.array(r["logits"], dtype=np.float32)
        paths, accepted = our_round(logits, budget, r["continuation"], vocab)
        assert len(set(paths)) == len(paths) == budget, f"round {r['round']}: duplicate or missing nodes"
        ours, theirs = set(paths), {tuple(p) for p in r["tree"]}
        assert ours == theirs, (
            f"round {r['round']}: only ours {sorted(ours - theirs)}, only the reference's {sorted(theirs - ours)}"
        )
        assert accepted == r["accepted"], f"round {r['round']}: accepted {accepted}, reference {r['accepted']}"
