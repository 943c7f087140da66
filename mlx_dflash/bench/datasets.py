"""Benchmark prompts: the DFlash paper's five evaluation sets, worded as its reference benchmark words them,
and four input-grounded sets, where a good reply copies much of its prompt (what prompt lookup is built for).

Paper sets: gsm8k, math500, humaneval, mbpp, mt-bench.
Input-grounded sets:
- code-comment-humaneval: comment a HumanEval function (prompt + canonical solution), replying with the whole code;
- code-rename-mbpp: rename the tested function of an MBPP test-split solution everywhere, replying with the code;
- summary-sharegpt: summarise a ShareGPT reply, reusing its wording;
- passage-qa: quote, from a ShareGPT reply, the paragraph that begins with given words, then explain it.
The two ShareGPT sets take each conversation's first `gpt` reply of 400-2000 characters (ids: the ShareGPT `id`).
ShareGPT is the training set of the shipped drafter: these two sets reuse its training text, which is fine
for measuring lookup but biases DFlash's acceptance upwards.

Each set is read from a local directory (`data_dir`, the file names of `../shared/data`)
or, without one, downloaded from the Hugging Face Hub under its official dataset id.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DFlashError
from ..loading.hub import snapshot

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
MBPP_TEST_IDS = range(11, 511)  # the sanitized set's test split
CODE_COMMENT = (
    "Add comments to the following code that explain what each step does, without changing any of its code. "
    "Reply with the whole code, comments included, in one ```python block.\n```python\n{code}```"
)
CODE_RENAME = (
    "Rename the function `{old}` to `{new}` in the following code: its definition and every use of it. "
    "Change nothing else and reply with the whole code in one ```python block.\n```python\n{code}\n```"
)
SUMMARY = "Summarise the following text in a few sentences, reusing its own wording where you can:\n\n{text}"
PASSAGE_QA = (
    "Answer from the passage below.\n\nPassage:\n{text}\n\nQuestion: what does the passage say in the paragraph "
    'that begins "{cue}"? Quote that paragraph word for word, then explain it in one sentence.'
)
PASSAGE_CHARS = range(400, 2001)  # length of the ShareGPT replies used as passages


@dataclass(frozen=True)
class Prompt:
    """One benchmark item: the user turns of a conversation (MT-Bench has two)."""

    dataset: str
    id: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Source:
    local_file: str  # name in a --data-dir
    repo_id: str  # official Hugging Face dataset id
    hub_patterns: tuple[str, ...]  # files of the split inside that repo


def _gsm8k(r: dict, i: int) -> tuple[str, tuple[str, ...]]:
    return str(i), (r["question"] + REASON,)


def _math500(r: dict, i: int) -> tuple[str, tuple[str, ...]]:
    return str(r.get("unique_id", i)), (r["problem"] + REASON,)


def _humaneval(r: dict, i: int) -> tuple[str, tuple[str, ...]]:
    return str(r["task_id"]), (HUMANEVAL.format(prompt=r["prompt"]),)


def _mbpp(r: dict, i: int) -> tuple[str, tuple[str, ...]] | None:
    if int(r["task_id"]) not in MBPP_TEST_IDS:
        return None
    return str(r["task_id"]), (r["prompt"],)


def _mt_bench(r: dict, i: int) -> tuple[str, tuple[str, ...]]:
    turns = r.get("turns", r.get("prompt"))
    return str(r.get("question_id", i)), tuple(turns)


def _code_comment(r: dict, i: int) -> tuple[str, tuple[str, ...]]:
    return str(r["task_id"]), (CODE_COMMENT.format(code=r["prompt"] + r["canonical_solution"].rstrip("\n") + "\n"),)


def _code_rename(r: dict, i: int) -> tuple[str, tuple[str, ...]] | None:
    """Renames the function the tests call (else the first one defined) to NAME_v2."""
    names = re.findall(r"^def\s+(\w+)\s*\(", r["code"], re.M)
    if int(r["task_id"]) not in MBPP_TEST_IDS or not names:
        return None
    tests = " ".join(r.get("test_list") or ())
    old = next((n for n in names if re.search(rf"\b{n}\s*\(", tests)), names[0])
    return str(r["task_id"]), (CODE_RENAME.format(old=old, new=old + "_v2", code=r["code"].strip()),)


def _sharegpt_passage(r: dict) -> str | None:
    """The first `gpt` reply of a ShareGPT conversation whose length is in PASSAGE_CHARS."""
    for turn in r.get("conversations") or ():
        text = turn.get("value") if isinstance(turn, dict) else None
        if isinstance(text, str) and turn.get("from") == "gpt" and len(text.strip()) in PASSAGE_CHARS:
            return text.strip()
    return None


def _summary(r: dict, i: int) -> tuple[str, tuple[str, ...]] | None:
    text = _sharegpt_passage(r)
    return (str(r["id"]), (SUMMARY.format(text=text),)) if text else None


def _passage_qa(r: dict, i: int) -> tuple[str, tuple[str, ...]] | None:
    """Asks for the passage's longest paragraph by its first six words (skipped when short or ambiguous)."""
    text = _sharegpt_passage(r)
    if not text:
        return None
    words = max(text.splitlines(), key=len).split()
    cue = " ".join(words[:6])
    if len(words) < 12 or text.count(cue) != 1:
        return None
    return str(r["id"]), (PASSAGE_QA.format(text=text, cue=cue),)


HUMANEVAL_SOURCE = Source("humaneval.jsonl.gz", "openai/openai_humaneval", ("openai_humaneval/test-*.parquet",))
MBPP_SOURCE = Source("mbpp_sanitized.json", "google-research-datasets/mbpp", ("sanitized/test-*.parquet",))
SHAREGPT_SOURCE = Source("sharegpt_en_train.jsonl.gz", "anon8231489123/ShareGPT_Vicuna_unfiltered",
                         ("ShareGPT_V3_unfiltered_cleaned_split.json",))

# name -> (where it lives, record -> (id, user turns) or None to skip the record)
SOURCES: dict[str, tuple[Source, Callable]] = {
    "gsm8k": (Source("gsm8k_test.jsonl", "openai/gsm8k", ("main/test-*.parquet",)), _gsm8k),
    "math500": (Source("math500_test.jsonl", "HuggingFaceH4/MATH-500", ("test.jsonl",)), _math500),
    "humaneval": (HUMANEVAL_SOURCE, _humaneval),
    "mbpp": (MBPP_SOURCE, _mbpp),
    "mt-bench": (
        Source("mt_bench_questions.jsonl", "HuggingFaceH4/mt_bench_prompts", ("raw/question.jsonl",)),
        _mt_bench,
    ),
    "code-comment-humaneval": (HUMANEVAL_SOURCE, _code_comment),
    "code-rename-mbpp": (MBPP_SOURCE, _code_rename),
    "summary-sharegpt": (SHAREGPT_SOURCE, _summary),
    "passage-qa": (SHAREGPT_SOURCE, _passage_qa),
}
DATASETS = tuple(SOURCES)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a .jsonl / .json / .parquet file (optionally gzipped)."""
    name = path.name.removesuffix(".gz")
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DFlashError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(path).to_pylist()
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DFlashError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        if name.endswith(".json"):
            data = json.loads(text)
            return data if isinstance(data, list) else data.get("data", [data])
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None


def _prompts(name: str, records: Iterable[dict], convert: Callable, where: Path) -> list[Prompt]:
    out = []
    for i, r in enumerate(records):
        try:
            item = convert(r, i)
        except (KeyError, TypeError, ValueError) as e:
            raise DFlashError(f"{where}: record {i} is not a {name} record (missing {e})") from None
        if item is not None:
            out.append(Prompt(name, item[0], item[1]))
    return out


def _hub_files(source: Source, cache_dir: str | Path | None, local_files_only: bool) -> list[Path]:
    root = snapshot(source.repo_id, repo_type="dataset", allow_patterns=list(source.hub_patterns),
                    cache_dir=cache_dir, offline_only=local_files_only, hint="; pass --data-dir with local copies")
    files = sorted(f for pattern in source.hub_patterns for f in root.glob(pattern))
    if not files:
        raise DFlashError(f"dataset {source.repo_id}: no {', '.join(source.hub_patterns)} in {root}")
    return files


def load_prompts(
    name: str,
    data_dir: str | Path | None = None,
    *,
    limit: int | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> list[Prompt]:
    """Prompts of a named set (see DATASETS) or of a FILE.

    A FILE is .jsonl/.json (records with `turns`, `prompt`, `question` or `problem`) or
    .txt (one prompt per line).
    """
    if name in SOURCES:
        source, convert = SOURCES[name]
        if data_dir is not None:
            path = Path(data_dir).expanduser() / source.local_file
            if not path.exists():
                raise DFlashError(f"{path}: no such file (--data-dir must hold {source.local_file})")
            prompts = _prompts(name, read_records(path), convert, path)
        else:
            files = _hub_files(source, cache_dir, local_files_only)
            prompts = _prompts(name, (r for f in files for r in read_records(f)), convert, files[0].parent)
    else:
        prompts = load_file(Path(name).expanduser())
    if not prompts:
        raise DFlashError(f"dataset {name}: no prompts")
    return prompts[:limit] if limit is not None else prompts


def _file_record(r: Any, i: int) -> tuple[str, tuple[str, ...]]:
    if isinstance(r, str):
        return str(i), (r,)
    for key in ("turns", "prompt", "question", "problem", "text"):
        value = r.get(key)
        if isinstance(value, str) and value:
            return str(r.get("id", i)), (value,)
        if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            return str(r.get("id", i)), tuple(value)
    raise KeyError("turns/prompt/question/problem/text")


def load_file(path: Path) -> list[Prompt]:
    """A user's prompt file: .txt (one per line) or .jsonl/.json records."""
    if not path.is_file():
        raise DFlashError(
            f"{path}: unknown dataset and no such file (datasets: {', '.join(DATASETS)}, or a .jsonl/.json/.txt file)"
        )
    name = path.name.removesuffix(".gz")
    if name.endswith(".txt"):
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [Prompt(path.stem, str(i), (line,)) for i, line in enumerate(lines)]
    if not name.endswith((".jsonl", ".json", ".parquet")):
        raise DFlashError(f"{path}: prompt files must be .txt, .jsonl, .json or .parquet")
    return _prompts(path.stem, read_records(path), _file_record, path)
