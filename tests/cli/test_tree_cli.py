"""`--tree-budget` and `--tree-shape` in generate, chat and serve: help, usage errors, identical output,
`tree_sizes` in `generate --json`, and a clear refusal where the pair cannot verify trees."""

from __future__ import annotations

import json
import re

import pytest
from helpers.families import cached_pair
from helpers.serverkit import free_port
from helpers.tiny import tiny_tokenizer
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

import mlx_dflash
from mlx_dflash.errors import DFlashError

_register()


def flat(text: str) -> str:
    """Help text with Rich's table borders and line wraps removed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def generate(pair, *args: str):
    target, drafter = pair
    return CliRunner().invoke(app, ["generate", "--model", target, "--draft", drafter, "--prompt-ids", "1,2,3",
                                    "--max-tokens", "24", "--block-size", "8", *args])


def generate_json(pair, *args: str) -> dict:
    result = generate(pair, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_explains_the_tree_options(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    text = flat(result.output)
    assert result.exit_code == 0 and "--tree-budget" in text and "--tree-shape" in text
    for phrase in ("verify each drafted block as a tree of N nodes", "0: linear blocks",
                   "auto: let --block-size auto weigh trees", "spine (default: the linear draft plus",
                   "paper (the N likeliest nodes"):
        assert phrase in text, phrase
    assert ("in a batch (--max-batch) verify linear blocks" in text) == (command == "serve")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize(("option", "value", "message"), [
    ("--tree-budget", "-1", "tree budget must be 'auto', 0 or a positive integer"),
    ("--tree-budget", "many", "tree budget must be 'auto', 0 or a positive integer"),
    ("--tree-shape", "bush", "tree shape must be one of spine, paper"),
])
def test_bad_values_are_usage_errors_before_anything_loads(command, option, value, message, tmp_path):
    result = CliRunner().invoke(app, [command, "--model", str(tmp_path / "missing"), option, value],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in flat(result.output), result.output


def test_generate_with_a_tree_budget_gives_the_same_tokens_and_reports_tree_sizes(pair):
    linear = generate_json(pair)
    assert set(linear["tree_sizes"]) == {0} and linear["tree_budget"] == 0
    for args, nodes in ((("--tree-budget", "16"), 16), (("--tree-budget", "4", "--tree-shape", "paper"), 4)):
        trees = generate_json(pair, *args)
        assert trees["token_ids"] == linear["token_ids"] and trees["text"] == linear["text"]
        sizes = trees["tree_sizes"]
        assert len(sizes) == len(trees["acceptance_lengths"]) and set(sizes) <= {0, nodes}
        assert sizes.count(0) <= trees["block_size_histogram"].get("1", 0)  # only plain steps are no trees
        assert trees["tree_budget"] == nodes and trees["tree_shape"] == ("paper" if nodes == 4 else "spine")
    spine = generate_json(pair, "--tree-budget", "4")["tree_sizes"]
    assert 7 in spine and set(spine) <= {0, 4, 5, 6, 7}  # max(4, block - 1): the linear draft and more
    text = generate(pair, "--tree-budget", "16")
    assert text.exit_code == 0 and "draft trees of up to 16 nodes" in flat(text.stderr)


@pytest.fixture
def hybrid(pair, monkeypatch, tmp_path):
    """The tiny pair's paths, loaded as a qwen3_5 (hybrid) target and a DFlash drafter."""
    model, drafter = cached_pair("qwen3_5")
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer")
    monkeypatch.setattr(mlx_dflash, "load", lambda *args, **kwargs: (model, tokenizer, drafter))
    return pair


def test_an_explicit_budget_on_a_hybrid_target_fails_clearly_and_auto_does_not(hybrid):
    result = generate(hybrid, "--block-size", "6", "--tree-budget", "32")
    assert isinstance(result.exception, DFlashError)
    assert str(result.exception).startswith("tree budget 32: qwen3_5 targets verify linear blocks only")
    auto = generate_json(hybrid, "--block-size", "6", "--tree-budget", "auto")
    assert set(auto["tree_sizes"]) == {0} and auto["generation_tokens"] >= 1
    assert auto["token_ids"] == generate_json(hybrid, "--block-size", "6")["token_ids"]


def test_serve_refuses_an_explicit_budget_a_hybrid_cannot_verify(hybrid):
    target, drafter = hybrid
    result = CliRunner().invoke(app, ["serve", "--model", target, "--draft", drafter, "--port", str(free_port()),
                                      "--block-size", "6", "--prompt-cache-dir", "off", "--tree-budget", "16"])
    assert isinstance(result.exception, DFlashError), result.output
    assert "tree budget 16: qwen3_5 targets verify linear blocks only" in str(result.exception)


def test_no_drafter_and_an_explicit_budget_fails_clearly(pair):
    result = generate(pair, "--no-draft", "--tree-budget", "8")
    assert isinstance(result.exception, DFlashError)
    assert "tree budget 8: trees need a DFlash v1 drafter" in str(result.exception)
    assert set(generate_json(pair, "--no-draft", "--tree-budget", "auto")["tree_sizes"]) == {0}


def chat(pair, script: str, *options: str):
    target, drafter = pair
    return CliRunner().invoke(app, ["chat", "--model", target, "--draft", drafter, "--max-tokens", "12",
                                    "--block-size", "8", "--no-color", *options], input=script)


def test_chat_with_trees_replies_as_without_and_counts_them(pair, tmp_path):
    saves = {}
    for name, options in (("linear", ()), ("trees", ("--tree-budget", "16", "--tree-shape", "paper"))):
        saves[name] = tmp_path / f"{name}.json"
        result = chat(pair, f"hi\n/stats\n/save {saves[name]}\n", *options)
        assert result.exit_code == 0, result.output
    linear, trees = (json.loads(saves[n].read_text()) for n in ("linear", "trees"))
    assert trees["messages"] == linear["messages"]
    assert trees["settings"]["tree_budget"] == 16 and trees["settings"]["tree_shape"] == "paper"
    assert 16 in trees["tree_sizes"] and set(linear["tree_sizes"]) == {0}
    result = chat(pair, "hi\n/stats\n/tree-budget 0\n/tree-budget lots\n/tree-budget\n", "--tree-budget", "16")
    out = flat(result.output)
    assert "draft trees of 16 nodes (spine)" in out  # the banner
    assert re.search(r"draft trees: \d+ of \d+ cycles, up to 16 nodes", out)
    assert "linear blocks" in out and "tree budget must be 'auto', 0 or a positive integer" in out
    assert "/tree-budget needs auto, 0 or a number of nodes" in out
