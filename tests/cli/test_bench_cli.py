"""`dflash-mlx bench` end to end on a tiny random pair (Typer's CliRunner, real files)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.paths import SHARED_DATA
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target
from mlx_dflash.cli.bench_cmd import parse_block_sizes, parse_contexts
from mlx_dflash.cli.main import _register, app
from typer.testing import CliRunner

from mlx_dflash.errors import DFlashError

DATA = SHARED_DATA
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")
_register()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_cli")
    target = tiny_target("llama", seed=2)
    save_target(target, "llama", root / "target")
    save_drafter(tiny_drafter(target, seed=5, block_size=8), drafter_config(target, block_size=8), root / "draft")
    return root / "target", root / "draft"


@needs_data
def test_bench_writes_json_and_report(pair, tmp_path):
    pytest.importorskip("matplotlib")
    target, draft = pair
    out, report = tmp_path / "bench.json", tmp_path / "report"
    result = CliRunner().invoke(app, [
        "bench", "--model", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--dataset", "mt-bench",
        "--data-dir", str(DATA), "--limit", "1", "--max-tokens", "6", "--block-size", "4,8", "--repeats", "2",
        "--json", str(out), "--report", str(report), "--no-think",
    ])
    assert result.exit_code == 0, result.output
    assert "dflash-b4" in result.output and "dflash-b8" in result.output
    doc = json.loads(out.read_text())
    modes = ["mlx-lm", "target", "lookup-auto", "dflash-b4", "dflash-b8"]  # (no auto: no dflash+lookup-auto)
    assert doc["ok"] is True and doc["config"]["modes"] == modes
    assert doc["config"]["block_sizes"] == [4, 8] and doc["config"]["think"] is False
    # gsm8k: 1 turn, mt-bench: 2 turns; x 2 repeats x 5 modes
    assert len(doc["records"]) == 3 * 2 * 5
    for r in doc["records"]:  # who proposed the accepted tokens
        assert set(r["accepted_by_source"]) <= {"lookup"} if r["mode"] == "lookup-auto" else \
            set(r["accepted_by_source"]) <= {"dflash"}
    assert {r["dataset"] for r in doc["summary"]} == {"gsm8k", "mt-bench", "all"}
    assert all(r["match"] for r in doc["records"])
    text = (report / "README.md").read_text()
    assert "all greedy outputs identical" in text and doc["command"] in text
    for png in ["acceptance_gsm8k.png", "acceptance_mt-bench.png", "speedup.png"]:
        assert (report / png).read_bytes()[:4] == b"\x89PNG" and f"({png})" in text


@needs_data
def test_context_sweep(pair, tmp_path):
    pytest.importorskip("matplotlib")
    target, draft = pair
    out, report = tmp_path / "ctx.json", tmp_path / "report"
    result = CliRunner().invoke(app, [
        "bench", "--model", str(target), "--draft", str(draft), "--dataset", "math500", "--data-dir", str(DATA),
        "--limit", "1", "--max-tokens", "4", "--context", "256,1k", "--json", str(out), "--report", str(report),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["config"]["contexts"] == [256, 1024]
    sizes = {(r["context"], r["mode"]): r["prompt_tokens"] for r in doc["records"]}
    assert abs(sizes[(1024, "dflash-auto")] - 1024) <= 8 and abs(sizes[(256, "mlx-lm")] - 256) <= 8
    assert (report / "context.png").exists() and "(context.png)" in (report / "README.md").read_text()


def test_report_without_matplotlib_names_the_extra(pair, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    target, _ = pair
    result = CliRunner().invoke(app, ["bench", "--model", str(target), "--dataset", "x.txt", "--report",
                                      str(tmp_path / "r")])
    assert isinstance(result.exception, DFlashError)
    assert "pip install 'mlx-dflash[report]'" in str(result.exception)
    assert not (tmp_path / "r").exists()


def test_user_file_without_drafter(pair, tmp_path):
    target, _ = pair
    prompts = tmp_path / "mine.txt"
    prompts.write_text("Say hello.\nSay goodbye.\n")
    out = tmp_path / "o.json"
    result = CliRunner().invoke(app, ["bench", "--model", str(target), "--dataset", str(prompts),
                                      "--max-tokens", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["config"]["modes"] == ["mlx-lm", "target", "lookup-auto"] and len(doc["records"]) == 6
    result = CliRunner().invoke(app, ["bench", "--model", str(target), "--dataset", str(prompts),
                                      "--max-tokens", "5", "--json", str(out), "--no-lookup"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["modes"] == ["mlx-lm", "target"]


def test_bad_input_is_one_clear_error(pair, tmp_path):
    target, _ = pair
    entry = "from mlx_dflash.cli.main import main; main()"  # the console script's code path
    proc = subprocess.run([sys.executable, "-c", entry, "bench", "--model", str(target), "--dataset", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") and "unknown dataset" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # one sentence (Rich may wrap it once)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    result = CliRunner().invoke(app, ["bench", "--model", str(target), "--block-size", "8", "--dataset", str(prompts)])
    assert isinstance(result.exception, DFlashError) and "--block-size needs a --draft" in str(result.exception)
    with pytest.raises(DFlashError, match="--context"):
        parse_contexts("1k,lots")
    with pytest.raises(DFlashError, match="--block-size"):
        parse_block_sizes(["8,0"])
    assert parse_block_sizes(["auto,16", "1", "AUTO"]) == ["auto", 16, 1]
    assert parse_contexts("1k, 4k,512") == [1024, 4096, 512] and parse_contexts(None) == [None]
    assert parse_block_sizes(["4,8", "16", "8"]) == [4, 8, 16]


@needs_data
def test_auto_fixed_and_oracle_modes(pair, tmp_path):
    """`--block-size auto,8,1` with benchmark-only oracle proposers: every output identical,
    block-size histograms and the cost model's prediction reported, no profiling by default."""
    target, draft = pair
    out = tmp_path / "auto.json"
    result = CliRunner().invoke(app, [
        "bench", "--model", str(target), "--draft", str(draft), "--dataset", "gsm8k", "--data-dir", str(DATA),
        "--limit", "1", "--max-tokens", "12", "--block-size", "auto,8,1", "--oracle-q", "0,0.5", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["config"]["block_sizes"] == ["auto", 8, 1] and doc["config"]["oracle_q"] == [0, 0.5]
    modes = doc["config"]["modes"]
    assert modes == ["mlx-lm", "target", "lookup-auto", "dflash-auto", "dflash-b8", "dflash-b1", "dflash+lookup-auto",
                     "oracle-q0-auto", "oracle-q0-b8", "oracle-q0-b1", "oracle-q0.5-auto", "oracle-q0.5-b8",
                     "oracle-q0.5-b1"]
    rows = {r["mode"]: r for r in doc["summary"]}
    assert rows["dflash-b1"]["block_size_histogram"] == {"1": rows["dflash-b1"]["cycles"]}
    assert set(rows["dflash-b8"]["block_size_histogram"]) <= {str(n) for n in range(1, 9)}
    assert rows["dflash-auto"]["predicted_tps"] > 0 and rows["dflash-b8"]["predicted_tps"] is None
    assert set(rows["dflash-auto"]["cycle_ms"]) == {"total"}  # the production loop: no profiling syncs
    assert rows["oracle-q0-b8"]["tau"] > 2  # a perfect oracle fills its blocks
    assert "--oracle-q 0,0.5" in doc["command"]
