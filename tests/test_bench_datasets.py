"""Benchmark prompt loaders: the shared evaluation files, user files, and the Hub cache layout."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from mlx_dflash.bench.datasets import DATASETS, HUMANEVAL, REASON, load_prompts, read_records
from mlx_dflash.errors import DFlashError

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # the repo's ../shared/data
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


@needs_data
@pytest.mark.parametrize("name, count", [
    ("gsm8k", 1319), ("math500", 500), ("humaneval", 164), ("mbpp", 257), ("mt-bench", 80),
])
def test_record_counts(name, count):
    prompts = load_prompts(name, DATA)
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count  # ids are unique
    assert all(p.dataset == name and all(t.strip() for t in p.turns) for p in prompts)


@needs_data
def test_prompt_wording():
    raw = read_records(DATA / "gsm8k_test.jsonl")
    gsm = load_prompts("gsm8k", DATA)
    assert gsm[5].turns == (raw[5]["question"] + REASON,)
    assert REASON == "\nPlease reason step by step, and put your final answer within \\boxed{}."

    raw = read_records(DATA / "math500_test.jsonl")
    assert load_prompts("math500", DATA)[0].turns == (raw[0]["problem"] + REASON,)

    he = load_prompts("humaneval", DATA)
    raw = read_records(DATA / "humaneval.jsonl.gz")
    assert he[0].id == "HumanEval/0"
    assert he[0].turns == (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{raw[0]['prompt']}\n```",
    )

    mbpp = load_prompts("mbpp", DATA)
    assert {int(p.id) for p in mbpp} <= set(range(11, 511))
    first = next(r for r in read_records(DATA / "mbpp_sanitized.json") if r["task_id"] == int(mbpp[0].id))
    assert mbpp[0].turns == (first["prompt"],)

    mt = load_prompts("mt-bench", DATA)
    assert all(len(p.turns) == 2 for p in mt)
    raw = read_records(DATA / "mt_bench_questions.jsonl")
    assert mt[0].turns == tuple(raw[0]["turns"]) and mt[0].id == str(raw[0]["question_id"])


@needs_data
def test_limit_keeps_the_first_prompts():
    assert [p.id for p in load_prompts("humaneval", DATA, limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_user_files(tmp_path):
    txt = tmp_path / "mine.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [p.turns for p in load_prompts(str(txt))] == [("first prompt",), ("second prompt",)]

    jl = tmp_path / "conv.jsonl.gz"
    with gzip.open(jl, "wt") as f:
        f.write(json.dumps({"id": "a", "turns": ["hi", "and then?"]}) + "\n")
        f.write(json.dumps({"prompt": "plain"}) + "\n")
    prompts = load_prompts(str(jl))
    assert prompts[0].id == "a" and prompts[0].turns == ("hi", "and then?")
    assert prompts[1].turns == ("plain",) and prompts[1].dataset == "conv.jsonl"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"answer": 1}) + "\n")
    with pytest.raises(DFlashError, match="record 0"):
        load_prompts(str(bad))


def test_bad_names_and_dirs(tmp_path):
    with pytest.raises(DFlashError, match="unknown dataset"):
        load_prompts("gsm9k")
    with pytest.raises(DFlashError, match="gsm8k_test.jsonl"):
        load_prompts("gsm8k", tmp_path)
    (tmp_path / "gsm8k_test.jsonl").write_text("{not json\n")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_prompts("gsm8k", tmp_path)


def _fake_hub_cache(root: Path, repo_id: str, files: dict[str, str]) -> None:
    """The layout huggingface_hub writes: datasets--org--name/{refs/main, snapshots/<sha>/...}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("datasets--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    for name, text in files.items():
        path = repo / "snapshots" / sha / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_hub_download_reads_the_local_cache(tmp_path):
    _fake_hub_cache(tmp_path, "HuggingFaceH4/MATH-500", {
        "test.jsonl": "".join(json.dumps({"problem": f"p{i}", "unique_id": f"u{i}"}) + "\n" for i in range(3)),
    })
    _fake_hub_cache(tmp_path, "HuggingFaceH4/mt_bench_prompts", {
        "raw/question.jsonl": json.dumps({"question_id": 81, "turns": ["one", "two"]}) + "\n",
    })
    math = load_prompts("math500", cache_dir=tmp_path, local_files_only=True)
    assert [p.turns for p in math] == [(f"p{i}{REASON}",) for i in range(3)]
    assert math[1].id == "u1"
    mt = load_prompts("mt-bench", cache_dir=tmp_path, local_files_only=True)
    assert mt[0].turns == ("one", "two") and mt[0].id == "81"
    with pytest.raises(DFlashError, match="openai/gsm8k is not in the local Hugging Face cache"):
        load_prompts("gsm8k", cache_dir=tmp_path, local_files_only=True)


def test_every_named_set_has_a_loader():
    assert set(DATASETS) == {"gsm8k", "math500", "humaneval", "mbpp", "mt-bench"}
    assert HUMANEVAL.format(prompt="X").endswith("```python\nX\n```")
