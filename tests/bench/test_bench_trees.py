"""Draft-tree modes in the bench: the `--tree-budget` / `--tree-shape` lists, the modes they make and
their names, refusals, and tiny-pair runs (runner and CLI) whose tree modes match the target and
report their tree sizes."""

from __future__ import annotations

import json

import pytest
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx_dflash.cli.bench_cmd import parse_tree_budgets, parse_tree_shapes
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

import mlx_dflash
from mlx_dflash.bench import BenchConfig, DFlashEngine, MlxLmEngine, Prompt, build_document, run_bench
from mlx_dflash.bench.engines import tree_refusal
from mlx_dflash.bench.modes import combinations, drop_refused, mode_name
from mlx_dflash.bench.proposers import CorruptedGreedyFactory
from mlx_dflash.bench.report import tree_text, write_report
from mlx_dflash.errors import DFlashError

_register()
PROMPTS = [Prompt("toy", "a", ("Tell me about the sea.",)), Prompt("toy", "b", ("Count to five.",))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_trees")
    target = tiny_target("qwen3", seed=0)
    save_target(target, "qwen3", root / "target")
    save_drafter(tiny_drafter(target, seed=1, block_size=8), drafter_config(target, block_size=8), root / "draft")
    (root / "prompts.txt").write_text("Tell me about the sea.\nCount to five.\n")
    return root


@pytest.fixture(scope="module")
def pair(saved):
    return mlx_dflash.load(str(saved / "target"), str(saved / "draft"))


def test_tree_lists_parse_like_block_sizes():
    assert parse_tree_budgets(["0,16", "auto", " 32", "16", "AUTO"]) == [0, 16, "auto", 32]
    assert parse_tree_budgets(None) == [] and parse_tree_budgets(["0"]) == [0]
    assert parse_tree_shapes(["spine,paper", "SPINE"]) == ["spine", "paper"]
    with pytest.raises(DFlashError, match="--tree-budget"):
        parse_tree_budgets(["16,-1"])
    with pytest.raises(DFlashError, match="--tree-budget"):
        parse_tree_budgets(["lots"])
    with pytest.raises(DFlashError, match="--tree-shape"):
        parse_tree_shapes(["spine,star"])


def test_combinations_collapse_what_cannot_differ():
    assert combinations(["auto", 8], [0, 16, 32, "auto"]) == [
        ("auto", 0, None), ("auto", 16, "spine"), ("auto", 32, "spine"), ("auto", "auto", "spine"),
        (8, 0, None), (8, 16, "spine"), (8, 32, "spine"),  # b8 with auto: the linear b8, once
    ]
    # Block size 1 drafts nothing: every budget is its linear mode; linear modes ignore the shape.
    assert combinations([1, 4], [0, 16], ["spine", "paper"]) == [(1, 0, None), (4, 0, None), (4, 16, "spine"),
                                                                 (4, 16, "paper")]
    assert combinations([8, "auto"]) == [(8, 0, None), ("auto", 0, None)]  # no --tree-budget: as before


def test_mode_names_are_readable_and_the_engine_uses_them(pair):
    assert mode_name(8) == "dflash-b8" and mode_name("auto") == "dflash-auto"
    assert mode_name(8, 32, "spine") == "dflash-b8 t32"
    assert mode_name("auto", "auto", "spine") == "dflash-auto t-auto"
    assert mode_name("auto", 32, "paper") == "dflash-auto t32 paper"
    model, tokenizer, draft = pair
    assert DFlashEngine(model, tokenizer, draft, 8).name == "dflash-b8"
    assert DFlashEngine(model, tokenizer, draft, 8, tree_budget=32).name == "dflash-b8 t32"
    engine = DFlashEngine(model, tokenizer, draft, "auto", lookup=True, tree_budget=32, tree_shape="paper")
    assert engine.name == "dflash+lookup-auto t32 paper" and engine.tree_shape == "paper"
    alone = DFlashEngine(model, tokenizer, None, tree_budget=16)  # no drafter, no trees
    assert alone.name == "target" and alone.tree_budget == 0 and alone.tree_shape is None


def test_refused_trees_skip_explicit_budgets_and_run_auto_linear(pair):
    modes = combinations(["auto", 8], [0, 16, "auto"], ["spine", "paper"])
    assert drop_refused(modes, None) == (modes, [])
    kept, skipped = drop_refused(modes, "no trees here")
    assert kept == [("auto", 0, None), (8, 0, None)]
    assert skipped == ["dflash-auto t16: no trees here", "dflash-auto t16 paper: no trees here",
                       "dflash-b8 t16: no trees here", "dflash-b8 t16 paper: no trees here"]
    assert drop_refused([(8, 16, "spine")], "no") == ([], ["dflash-b8 t16: no"])
    model, tokenizer, draft = pair
    assert tree_refusal(model, draft) is None
    assert "oracle" in tree_refusal(model, CorruptedGreedyFactory(model, tokenizer, 0.1, 8))

    class LinearProposer:  # a proposer that drafts linear blocks only (as DFlash2's)
        drafts_trees, block_size = False, 8

    assert "DFlash v1" in tree_refusal(model, LinearProposer())


@pytest.fixture(scope="module")
def tree_run(pair):
    model, tokenizer, draft = pair
    engines = [MlxLmEngine(model, tokenizer), DFlashEngine(model, tokenizer, draft, 8),
               DFlashEngine(model, tokenizer, draft, 8, tree_budget=16),
               DFlashEngine(model, tokenizer, draft, 4, tree_budget=12, tree_shape="paper")]
    result = run_bench(engines, tokenizer, PROMPTS, BenchConfig(max_tokens=20))
    doc = build_document(result, {"model": "m", "draft": "d", "datasets": ["toy"], "max_tokens": 20, "temp": 0.0,
                                  "block_sizes": [8, 4], "tree_budgets": [0, 16, 12], "tree_shapes": ["spine"],
                                  "repeats": 1, "skipped": ["dflash-b2 t16: (a test)"]})
    return result, json.loads(json.dumps(doc))


def test_tree_mode_matches_the_target_and_reports_tree_sizes(tree_run):
    result, doc = tree_run
    assert result.ok, result.failures
    assert [r.mode for r in result.records[:4]] == ["mlx-lm", "dflash-b8", "dflash-b8 t16", "dflash-b4 t12 paper"]
    for r in result.records:
        assert r.match is True
        if r.mode == "mlx-lm":
            assert r.tree_sizes == [] and r.tree_budget == 0 and r.tree_shape is None
        elif r.mode == "dflash-b8":
            assert set(r.tree_sizes) == {0} and len(r.tree_sizes) == len(r.acceptance_lengths)
        else:  # every drafting cycle (block > 1) verified a tree of the budget's nodes
            sizes = [b for b, n in r.block_size_histogram.items() for _ in range(n)]
            assert len(r.tree_sizes) == len(r.acceptance_lengths) == len(sizes)
            assert sum(n > 0 for n in r.tree_sizes) == sum(b > 1 for b in sizes) > 0
            assert set(r.tree_sizes) - {0} == {16 if r.mode == "dflash-b8 t16" else 12}
            assert r.tree_shape == ("spine" if r.mode == "dflash-b8 t16" else "paper")
    rows = {r["mode"]: r for r in doc["summary"]}
    assert rows["dflash-b8"]["tree_budget"] == 0 and rows["dflash-b8"]["tree_cycles"] == 0
    assert rows["dflash-b8"]["mean_tree_size"] is None and tree_text(rows["dflash-b8"]) == "-"
    tree = rows["dflash-b8 t16"]
    assert tree["tree_budget"] == 16 and tree["tree_shape"] == "spine" and tree["mean_tree_size"] == 16.0
    assert 0 < tree["tree_cycles"] <= tree["cycles"]
    assert tree_text(tree) == f"16.0 ({tree['tree_cycles']}/{tree['cycles']})"
    assert rows["dflash-b4 t12 paper"]["mean_tree_size"] == 12.0
    assert all(r["tree_sizes"] == rec.tree_sizes for r, rec in zip(doc["records"], result.records, strict=True))


def test_report_shows_tree_sizes_only_with_tree_modes(tree_run, tmp_path):
    pytest.importorskip("matplotlib")
    doc = tree_run[1]
    text = write_report(doc, tmp_path / "trees").read_text()
    assert "tree nodes (tree cycles/cycles)" in text and "| dflash-b8 t16 |" in text
    assert "tree budgets 0, 16, 12 (spine)" in text and "Skipped: dflash-b2 t16: (a test)." in text
    row = next(line for line in text.splitlines() if "| dflash-b8 t16 |" in line)
    assert "| 16.0 (" in row
    linear = dict(doc, summary=[r for r in doc["summary"] if not r["tree_budget"]],
                  config=dict(doc["config"], tree_budgets=[0], skipped=[]))
    text = write_report(linear, tmp_path / "linear").read_text()
    assert "tree" not in text.lower()  # a linear run's report is what it was


def _bench(saved, *args):
    return CliRunner().invoke(app, ["bench", "--model", str(saved / "target"), "--dataset",
                                    str(saved / "prompts.txt"), "--max-tokens", "16", *args])


def test_cli_runs_linear_and_tree_modes_side_by_side(saved, tmp_path):
    out = tmp_path / "t.json"
    result = _bench(saved, "--draft", str(saved / "draft"), "--block-size", "8", "--tree-budget", "0,16",
                    "--no-lookup", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "tree nodes" in result.output and "dflash-b8 t16" in result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["config"]["modes"] == ["mlx-lm", "target", "dflash-b8", "dflash-b8 t16"]
    assert doc["config"]["tree_budgets"] == [0, 16] and doc["config"]["tree_shapes"] == ["spine"]
    assert doc["config"]["skipped"] == [] and "--tree-budget 0,16" in doc["command"]
    assert all(r["match"] for r in doc["records"])
    tree = [r for r in doc["records"] if r["mode"] == "dflash-b8 t16"]
    assert len(tree) == 2 and all(set(r["tree_sizes"]) <= {0, 16} and 16 in r["tree_sizes"] for r in tree)
    rows = {r["mode"]: r for r in doc["summary"]}
    assert rows["dflash-b8 t16"]["mean_tree_size"] == 16.0 and rows["dflash-b8"]["tree_cycles"] == 0


def test_cli_without_tree_budget_is_unchanged(saved, tmp_path):
    out = tmp_path / "l.json"
    result = _bench(saved, "--draft", str(saved / "draft"), "--block-size", "8", "--no-lookup", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "tree nodes" not in result.output and " t16" not in result.output  # no tree column, no tree mode
    doc = json.loads(out.read_text())
    assert doc["config"]["modes"] == ["mlx-lm", "target", "dflash-b8"] and "--tree" not in doc["command"]
    assert all(r["tree_budget"] == 0 and r["tree_shape"] is None for r in doc["records"])


def test_cli_skips_refused_tree_modes_and_says_so(saved, tmp_path, monkeypatch):
    monkeypatch.setattr("mlx_dflash.bench.engines.tree_refusal", lambda model, drafter: "no trees here")
    out = tmp_path / "r.json"
    result = _bench(saved, "--draft", str(saved / "draft"), "--block-size", "auto,8", "--tree-budget", "0,16,auto",
                    "--no-lookup", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "skipped: dflash-auto t16: no trees here" in result.output
    assert "skipped: dflash-b8 t16: no trees here" in result.output
    assert "--tree-budget auto runs linear blocks here: no trees here" in result.output
    doc = json.loads(out.read_text())
    assert doc["config"]["modes"] == ["mlx-lm", "target", "dflash-auto", "dflash-b8"]  # auto ran linear, once
    assert doc["config"]["skipped"] == ["dflash-auto t16: no trees here", "dflash-b8 t16: no trees here"]
    # Nothing asked for can run: one error before the run.
    result = _bench(saved, "--draft", str(saved / "draft"), "--tree-budget", "16")
    assert isinstance(result.exception, DFlashError) and "no mode left to run" in str(result.exception)
    assert "dflash-auto t16: no trees here" in str(result.exception)


def test_cli_tree_budget_needs_a_drafter(saved):
    result = _bench(saved, "--tree-budget", "16")
    assert isinstance(result.exception, DFlashError) and "--tree-budget needs a --draft" in str(result.exception)
    result = _bench(saved, "--tree-budget", "0", "--no-lookup")  # linear only: nothing to refuse
    assert result.exit_code == 0, result.output
