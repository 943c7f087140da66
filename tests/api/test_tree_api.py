"""Draft trees through the Python API: `generate(..., tree_budget=N)` and the chat engine's settings.

Trees change the speed, never the output: greedy replies equal the target alone. An explicit budget
on a pair that cannot verify trees is refused with the reason; "auto" falls back to linear blocks.
"""

from __future__ import annotations

import pytest
from helpers.chat_turns import run_turn
from helpers.families import cached_pair
from helpers.tiny import EOS_ID, greedy_reference, tiny_drafter, tiny_target, tiny_tokenizer
from helpers.tiny_dflash2 import tiny_dflash2

from mlx_dflash import DFlashError, generate, stream_generate
from mlx_dflash.chat import ChatEngine, ChatSettings

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tree-tokenizer"))


@pytest.fixture(scope="module")
def pair():
    model = tiny_target("qwen3", seed=0)
    return model, tiny_drafter(model, block_size=6)


def run(model, tokenizer, drafter, **kwargs) -> tuple[list[int], list[int]]:
    """(tokens, each cycle's tree size) of one greedy generation."""
    events = list(stream_generate(model, tokenizer, PROMPT, draft_model=drafter, max_tokens=30, **kwargs))
    return [t for e in events for t in e.tokens], events[-1].stats.tree_sizes


def reference(model, n: int = 30) -> list[int]:
    out = greedy_reference(model, PROMPT, n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


@pytest.mark.parametrize("shape", ["spine", "paper"])
def test_a_tree_budget_gives_the_target_alone(pair, tokenizer, shape):
    model, drafter = pair
    expected = reference(model)
    tokens, trees = run(model, tokenizer, drafter, block_size=6, tree_budget=16, tree_shape=shape)
    assert tokens == expected
    assert set(trees) <= {0, 16} and trees.count(16) >= len(trees) - 2  # the last cycles may be plain steps
    assert generate(model, tokenizer, PROMPT, draft_model=drafter, max_tokens=30, block_size=6,
                    tree_budget=16, tree_shape=shape) == tokenizer.decode(expected)
    linear, none = run(model, tokenizer, drafter, block_size=6)  # the default budget: 0
    assert linear == expected and set(none) == {0}


def test_a_spine_tree_holds_at_least_the_linear_draft(pair, tokenizer):
    model, drafter = pair
    tokens, trees = run(model, tokenizer, drafter, block_size=6, tree_budget=2)
    assert tokens == reference(model)
    assert 5 in trees and set(trees) <= {0, 2, 3, 4, 5}  # max(2, block - 1) nodes


def test_the_default_auto_block_size_takes_a_tree_budget(pair, tokenizer):
    model, drafter = pair
    tokens, trees = run(model, tokenizer, drafter, tree_budget=16)
    assert tokens == reference(model) and len(trees) >= 1


@pytest.mark.parametrize("case", ["qwen3_5", "gemma3_text", "no drafter", "dflash2"])
def test_an_explicit_budget_is_refused_where_trees_cannot_be_verified(tokenizer, case):
    if case in ("qwen3_5", "gemma3_text"):
        model, drafter = cached_pair(case)
        reason = f"{case} targets verify linear blocks only"
    else:
        model = tiny_target("qwen3", seed=0)
        drafter = None if case == "no drafter" else tiny_dflash2(model, block_size=6)[0]
        reason = "trees need a DFlash v1 drafter"
    with pytest.raises(DFlashError, match=f"tree budget 32: {reason}"):
        run(model, tokenizer, drafter, block_size=6, tree_budget=32)
    # "auto" never fails: linear blocks, the same reply.
    tokens, trees = run(model, tokenizer, drafter, block_size=6, tree_budget="auto")
    assert set(trees) <= {0}
    assert tokens == run(model, tokenizer, drafter, block_size=6, tree_budget=0)[0]


def test_bad_values_are_refused(pair, tokenizer):
    model, drafter = pair
    with pytest.raises(DFlashError, match="tree budget must be"):
        run(model, tokenizer, drafter, tree_budget=-1)
    with pytest.raises(DFlashError, match="tree shape must be one of spine, paper"):
        run(model, tokenizer, drafter, tree_shape="bush")


def test_the_chat_engine_verifies_trees_as_its_settings_say(pair, tokenizer, tmp_path):
    model, drafter = pair
    linear = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=16, block_size=6))
    trees = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=16, block_size=6, tree_budget="16"))
    assert trees.settings.tree_budget == 16 and trees.settings.tree_shape == "spine"
    for text in ("hello", "and then?"):
        assert run_turn(trees, text).tokens == run_turn(linear, text).tokens
    assert 16 in trees.totals.tree_sizes and set(linear.totals.tree_sizes) == {0}
    assert len(trees.totals.tree_sizes) == len(trees.totals.acceptance_lengths)
    trees.set_trees(0)
    turn = run_turn(trees, "more")
    assert set(turn.stats.tree_sizes) == {0}
    trees.set_trees(8, "paper")
    assert (trees.settings.tree_budget, trees.settings.tree_shape) == (8, "paper")
    trees.save(tmp_path / "c.safetensors")  # the settings travel with a saved chat
    again = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=16))
    again.load(tmp_path / "c.safetensors")
    assert (again.settings.tree_budget, again.settings.tree_shape) == (8, "paper")
    assert 8 in run_turn(again, "go on").stats.tree_sizes


def test_the_chat_engine_refuses_an_explicit_budget_a_hybrid_cannot_verify(tokenizer):
    model, drafter = cached_pair("qwen3_5")
    with pytest.raises(DFlashError, match="tree budget 16: qwen3_5 targets"):
        ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=8, tree_budget=16))
    engine = ChatEngine(model, tokenizer, drafter, ChatSettings(max_tokens=8, tree_budget="auto"))
    with pytest.raises(DFlashError, match="qwen3_5 targets"):
        engine.set_trees(16)
    assert engine.settings.tree_budget == "auto"  # unchanged by the refusal
    assert set(run_turn(engine, "hi").stats.tree_sizes) <= {0}
