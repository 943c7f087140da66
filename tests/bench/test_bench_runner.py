"""The bench runner on a tiny random pair: interleaved modes, the greedy mismatch check, figures, JSON schema."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from helpers.paths import REPO
from helpers.tiny import drafter_config, save_drafter, save_target, tiny_drafter, tiny_target

import mlx_dflash
from mlx_dflash.bench import (
    BenchConfig,
    DFlashEngine,
    MlxLmEngine,
    Prompt,
    Record,
    Run,
    build_document,
    run_bench,
    summarize,
)
from mlx_dflash.bench.runner import first_mismatch
from mlx_dflash.bench.stats import paired_ratio

DOCS = REPO / "docs" / "bench.md"
PROMPTS = [
    Prompt("toy", "a", ("Tell me about the sea.",)),
    Prompt("toy", "b", ("Count to five.", "Now backwards.")),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_pair")
    target = tiny_target("qwen3", seed=0)
    drafter = tiny_drafter(target, seed=1, block_size=8)
    save_target(target, "qwen3", root / "target")
    save_drafter(drafter, drafter_config(target, block_size=8), root / "draft")
    model, tokenizer, draft = mlx_dflash.load(str(root / "target"), str(root / "draft"))
    return model, tokenizer, draft


def engines(pair, *extra):
    model, tokenizer, draft = pair
    return [MlxLmEngine(model, tokenizer), DFlashEngine(model, tokenizer, None),
            DFlashEngine(model, tokenizer, draft, 4), *extra]


class LossyEngine:
    """A deliberately wrong engine: DFlash with one generated token changed."""

    def __init__(self, inner: DFlashEngine, at: int = 3):
        self.inner, self.at = inner, at
        self.name, self.block_size = "lossy", inner.block_size

    def run(self, prompt_ids, **kwargs) -> Run:
        run = self.inner.run(prompt_ids, **kwargs)
        if len(run.tokens) > self.at:
            run.tokens[self.at] = (run.tokens[self.at] + 1) % 100 + 4
        return run


def test_modes_interleave_and_greedy_outputs_match(pair):
    config = BenchConfig(max_tokens=12, repeats=2)
    result = run_bench(engines(pair), pair[1], PROMPTS, config)
    assert result.ok and result.failures == []
    # 3 prompt turns x 2 repeats x 3 modes, modes interleaved per prompt turn
    assert len(result.records) == 18
    assert [r.mode for r in result.records[:6]] == ["mlx-lm", "target", "dflash-b4"] * 2
    assert all(r.match is True and r.first_mismatch is None for r in result.records)
    for r in result.records:
        assert 1 <= r.generated_tokens <= 12
        if r.mode == "dflash-b4":
            # every token after the prefill's came from a verify cycle of at most 4 tokens
            assert sum(r.acceptance_lengths) >= r.generated_tokens - 1
            assert all(1 <= n <= 4 for n in r.acceptance_lengths)
        else:
            assert r.acceptance_lengths == [] and r.draft_s == 0.0
    # MT-Bench style: the second turn's prompt holds the first turn and its answer
    b = [r for r in result.records if r.prompt_id == "b" and r.mode == "mlx-lm" and r.repeat == 0]
    assert b[1].prompt_tokens > b[0].prompt_tokens + b[0].generated_tokens


class CallLog:
    """An engine wrapper that logs when it is run."""

    def __init__(self, inner, log: list[str]):
        self.inner, self.log = inner, log
        self.name, self.block_size = inner.name, inner.block_size

    def run(self, prompt_ids, **kwargs) -> Run:
        self.log.append(self.name)
        return self.inner.run(prompt_ids, **kwargs)


def test_the_mode_that_runs_first_rotates(pair):
    log: list[str] = []
    logged = [CallLog(e, log) for e in engines(pair)]
    result = run_bench(logged, pair[1], PROMPTS, BenchConfig(max_tokens=6, repeats=2))
    warm, timed = log[:3], log[3:]
    assert warm == ["mlx-lm", "target", "dflash-b4"]
    rounds = [timed[i : i + 3] for i in range(0, len(timed), 3)]
    assert rounds[:4] == [["mlx-lm", "target", "dflash-b4"], ["target", "dflash-b4", "mlx-lm"],
                          ["dflash-b4", "mlx-lm", "target"], ["mlx-lm", "target", "dflash-b4"]]
    # Records stay in engine order, and mlx-lm (engines[0]) is still the reference when it runs last.
    assert [r.mode for r in result.records[:6]] == ["mlx-lm", "target", "dflash-b4"] * 2
    assert result.ok and all(r.match for r in result.records)


def test_lossy_engine_is_reported_as_a_failure(pair):
    model, tokenizer, draft = pair
    lossy = LossyEngine(DFlashEngine(model, tokenizer, draft, 4))
    result = run_bench(engines(pair, lossy), tokenizer, PROMPTS[:1], BenchConfig(max_tokens=10))
    assert not result.ok
    assert len(result.failures) == 1 and "lossy differs from mlx-lm at generated token 3" in result.failures[0]
    bad = [r for r in result.records if r.mode == "lossy"]
    assert bad[0].match is False and bad[0].first_mismatch == 3
    assert all(r.match for r in result.records if r.mode != "lossy")
    rows = {row["mode"]: row for row in summarize(result.records)}
    assert rows["lossy"]["mismatches"] == 1 and rows["dflash-b4"]["mismatches"] == 0
    doc = build_document(result, {})
    assert doc["ok"] is False and doc["failures"] == result.failures


def test_sampled_runs_are_not_compared(pair):
    model, tokenizer, draft = pair
    lossy = LossyEngine(DFlashEngine(model, tokenizer, draft, 4))
    result = run_bench([MlxLmEngine(model, tokenizer), lossy], tokenizer, PROMPTS[:1],
                       BenchConfig(max_tokens=8, temp=0.8, seed=3))
    assert result.ok and all(r.match is None for r in result.records)


def test_context_padding_reaches_the_requested_length(pair):
    model, tokenizer, _ = pair
    config = BenchConfig(max_tokens=4, contexts=(None, 300))
    result = run_bench([MlxLmEngine(model, tokenizer)], tokenizer, PROMPTS[:1] + [Prompt("toy", "c", ("Hi",))],
                       config)
    plain = [r for r in result.records if r.context is None]
    padded = [r for r in result.records if r.context == 300]
    assert len(plain) == len(padded) == 2
    assert all(abs(r.prompt_tokens - 300) <= 8 for r in padded)  # char tokenizer: padding is near exact
    assert all(r.prompt_tokens < 100 for r in plain)


def _rec(mode, repeat, tokens, decode_s, lengths=(), dataset="d", draft=0.0, verify=0.0):
    return Record(dataset, "p", 0, None, repeat, mode, None, 10, tokens, 0.1 * (repeat + 1), decode_s,
                  (tokens - 1) / decode_s, 1.0, "length", list(lengths), draft, verify, True, None)


def test_summary_figures():
    records = [
        _rec("mlx-lm", 0, 11, 1.0), _rec("target", 0, 11, 2.0), _rec("dflash-b4", 0, 11, 0.5, [4, 1, 3, 2], draft=0.1,
                                                                       verify=0.3),
        _rec("mlx-lm", 1, 11, 2.0), _rec("target", 1, 11, 2.0), _rec("dflash-b4", 1, 11, 0.5, [4, 1, 3, 2]),
    ]
    rows = {r["mode"]: r for r in summarize(records)}
    d = rows["dflash-b4"]
    assert d["tau"] == pytest.approx(2.5) and d["cycles"] == 8
    assert d["acceptance_histogram"] == [0, 2, 2, 2, 2]
    assert d["decode_tps"] == {"median": 20.0, "min": 20.0, "max": 20.0}
    assert d["speedup"] == {"median": pytest.approx(3.0), "min": pytest.approx(2.0), "max": pytest.approx(4.0)}
    assert d["speedup_vs_target"]["median"] == pytest.approx(4.0)
    assert d["paired_vs_target"] == {"ratio": pytest.approx(4.0), "low": pytest.approx(4.0), "high": pytest.approx(4.0)}
    assert rows["target"]["paired_vs_target"]["ratio"] == pytest.approx(1.0)
    assert d["cycle_ms"]["draft"] == pytest.approx(12.5) and d["cycle_ms"]["verify"] == pytest.approx(37.5)
    assert d["cycle_ms"]["overhead"] == pytest.approx(1e3 * (1.0 - 0.4) / 8)
    assert d["ttft_s"]["median"] == pytest.approx(0.15)
    assert rows["mlx-lm"]["tau"] is None and rows["mlx-lm"]["speedup"]["median"] == pytest.approx(1.0)
    assert first_mismatch([1, 2, 3], [1, 2]) == 2 and first_mismatch([1, 2], [1, 2]) is None


def test_paired_interval_cancels_what_hits_both_modes_alike():
    # Prompt "fast" decodes 5x faster than prompt "slow" in both modes; the mode is always 2x the target.
    records = []
    for repeat in range(4):
        for prompt, seconds in (("fast", 1.0), ("slow", 5.0)):
            for mode, factor in (("target", 1.0), ("dflash-auto", 0.5)):
                r = _rec(mode, repeat, 11, seconds * factor)
                r.prompt_id = prompt
                records.append(r)
    paired = paired_ratio([r for r in records if r.mode == "dflash-auto"], [r for r in records if r.mode == "target"])
    assert paired == {"ratio": pytest.approx(2.0), "low": pytest.approx(2.0), "high": pytest.approx(2.0)}
    # Noise of its own widens the interval around the pooled ratio; the same records give the same interval.
    for i, r in enumerate(r for r in records if r.mode == "dflash-auto"):
        r.decode_s *= 1.0 + 0.1 * (i % 3 - 1)
    mode, base = [r for r in records if r.mode == "dflash-auto"], [r for r in records if r.mode == "target"]
    noisy = paired_ratio(mode, base)
    assert noisy["low"] < noisy["ratio"] < noisy["high"] and noisy["high"] - noisy["low"] > 0.05
    assert paired_ratio(mode, base) == noisy
    assert paired_ratio(mode, []) is None


def _documented(section: str) -> list[str]:
    text = DOCS.read_text().split(section, 1)[1].split("\n\n", 2)[1]
    return re.findall(r"^\| `(\w+)` \|", text, flags=re.M)


def test_json_schema_matches_the_documentation(pair):
    model, tokenizer, draft = pair
    result = run_bench(engines(pair), tokenizer, PROMPTS[:1], BenchConfig(max_tokens=6))
    config = {"model": "m", "draft": "d"}
    doc = build_document(result, config, "dflash-mlx bench --model m")
    assert doc["schema_version"] == 1 and doc["ok"] is True and doc["config"] == config
    assert list(doc) == _documented("Top level:")
    assert [f.name for f in fields(Record)] == _documented("Per-prompt record")
    assert all(list(r) == _documented("Per-prompt record") for r in doc["records"])
    assert all(list(row) == _documented("Summary row") for row in doc["summary"])
    assert len(doc["records"]) == 3 and len(doc["summary"]) == 3
