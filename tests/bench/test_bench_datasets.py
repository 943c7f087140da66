"""Benchmark prompt loaders: the shared evaluation files, the input-grounded sets, user files, the Hub cache layout."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from helpers.paths import SHARED_DATA

from mlx_dflash.bench.datasets import DATASETS, HUMANEVAL, REASON, SUMMARY, load_prompts, read_records
from mlx_dflash.errors import DFlashError

DATA = SHARED_DATA  # the repo's ../shared/data
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


@needs_data
@pytest.mark.parametrize("name, count", [
    ("gsm8k", 1319), ("math500", 500), ("humaneval", 164), ("mbpp", 257), ("mt-bench", 80),
    ("code-comment-humaneval", 164), ("code-rename-mbpp", 257), ("summary-sharegpt", 8826), ("passage-qa", 8490),
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
    assert [p.id for p in load_prompts("code-comment-humaneval", DATA, limit=2)] == ["HumanEval/0", "HumanEval/1"]
    assert [p.id for p in load_prompts("code-rename-mbpp", DATA, limit=2)] == ["11", "12"]
    assert len(load_prompts("passage-qa", DATA, limit=5)) == 5


@needs_data
def test_input_grounded_prompts_hold_their_input():
    raw = {r["task_id"]: r for r in read_records(DATA / "humaneval.jsonl.gz")}
    for p in load_prompts("code-comment-humaneval", DATA):
        r = raw[p.id]
        code = r["prompt"] + r["canonical_solution"].rstrip("\n")  # one final newline
        assert p.turns[0].endswith(f"```python\n{code}\n```")
        assert f"def {r['entry_point']}(" in p.turns[0]

    raw = {str(r["task_id"]): r for r in read_records(DATA / "mbpp_sanitized.json")}
    rename = load_prompts("code-rename-mbpp", DATA)
    for p in rename:
        old, new = re.findall(r"`(\w+)`", p.turns[0])[:2]
        assert new == old + "_v2" and raw[p.id]["code"].strip() in p.turns[0]
        assert re.search(rf"^def\s+{old}\s*\(", p.turns[0], re.M) and old in raw[p.id]["test_list"][0]
    assert {p.id: p.turns[0].split("`")[1] for p in rename}["56"] == "check"  # the tested one of two functions

    raw = {r["id"]: r for r in read_records(DATA / "sharegpt_en_train.jsonl.gz")}
    summary = load_prompts("summary-sharegpt", DATA)
    for p in summary[:200]:
        replies = [t["value"].strip() for t in raw[p.id]["conversations"] if t["from"] == "gpt"]
        text = next(t for t in replies if 400 <= len(t) <= 2000)  # the first reply that fits
        assert p.turns == (SUMMARY.format(text=text),)
    qa = load_prompts("passage-qa", DATA)
    assert {p.id for p in qa} <= {p.id for p in summary}  # same passages, fewer (short/ambiguous cues skipped)
    passages = {p.id: p.turns[0].removeprefix(SUMMARY.format(text="")) for p in summary}
    for p in qa[:200]:
        cue = re.search(r'begins "(.*)"\? Quote', p.turns[0]).group(1)
        assert p.turns[0].startswith(f"Answer from the passage below.\n\nPassage:\n{passages[p.id]}\n\n")
        assert len(cue.split()) == 6 and passages[p.id].count(cue) == 1


def test_input_grounded_records_that_do_not_fit_are_skipped(tmp_path):
    fit = " ".join(f"w{i}" for i in range(120))  # 489 characters, one paragraph
    repeated = "this line of the passage repeats itself word for word many times\n" * 8
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": fit}, {"from": "gpt", "value": "too short"},
                                      {"from": "gpt", "value": fit}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "x" * 2001}]},
        {"id": "c"},
        {"id": "d", "conversations": [{"from": "gpt", "value": repeated}]},
    ]
    with gzip.open(tmp_path / "sharegpt_en_train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    summary = load_prompts("summary-sharegpt", tmp_path)
    assert [p.id for p in summary] == ["a", "d"] and summary[0].turns == (SUMMARY.format(text=fit.strip()),)
    assert [p.id for p in load_prompts("passage-qa", tmp_path)] == ["a"]  # d's paragraphs all begin alike

    (tmp_path / "mbpp_sanitized.json").write_text(json.dumps([
        {"task_id": 5, "code": "def f(x):\n    return x"},  # train split
        {"task_id": 11, "code": "x = 1"},  # no function
        {"task_id": 12, "code": "def g(x):\n    return h(x)\ndef h(x):\n    return x", "test_list": ["assert h(1)"]},
    ]))
    (p,) = load_prompts("code-rename-mbpp", tmp_path)
    assert p.id == "12" and "`h` to `h_v2`" in p.turns[0]


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

    passage = "A short first paragraph.\n" + " ".join(f"word{i}" for i in range(80))
    _fake_hub_cache(tmp_path, "anon8231489123/ShareGPT_Vicuna_unfiltered", {
        "ShareGPT_V3_unfiltered_cleaned_split.json": json.dumps([
            {"id": f"c{i}_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": passage}]}
            for i in range(3)
        ]),
    })
    summary = load_prompts("summary-sharegpt", cache_dir=tmp_path, local_files_only=True, limit=2)
    assert [p.id for p in summary] == ["c0_0", "c1_0"] and summary[0].turns == (SUMMARY.format(text=passage.strip()),)
    qa = load_prompts("passage-qa", cache_dir=tmp_path, local_files_only=True)
    assert len(qa) == 3 and 'begins "word0 word1 word2 word3 word4 word5"?' in qa[0].turns[0]


def test_every_named_set_has_a_loader():
    assert set(DATASETS) == {"gsm8k", "math500", "humaneval", "mbpp", "mt-bench",
                             "code-comment-humaneval", "code-rename-mbpp", "summary-sharegpt", "passage-qa"}
    with pytest.raises(DFlashError, match="passage-qa"):
        load_prompts("passage-qb")
    assert HUMANEVAL.format(prompt="X").endswith("```python\nX\n```")
