"""The conversations' user turns: MT-Bench (two turns), GSM8K and HumanEval, from ../shared/data."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = ("Write a solution to the following problem and make sure that it passes the tests:\n"
             "```python\n{prompt}\n```")
FOLLOW_UPS = {"gsm8k": "Check your answer once more, then state it again in one line.",
              "humaneval": "Now write two short tests for your solution.",
              "mt_bench": "Summarize your two answers in one sentence."}


def load_prompts(data: Path) -> dict[str, list]:
    """Conversations' user turns: MT-Bench (two turns), GSM8K and HumanEval (one, a follow-up may come)."""
    try:
        mt = [json.loads(line)["turns"] for line in (data / "mt_bench_questions.jsonl").read_text().splitlines()
              if line.strip()]
        gsm = [[json.loads(line)["question"] + REASON] for line in (data / "gsm8k_test.jsonl").read_text().splitlines()
               if line.strip()]
        with gzip.open(data / "humaneval.jsonl.gz", "rt") as f:
            he = [[HUMANEVAL.format(prompt=json.loads(line)["prompt"])] for line in f if line.strip()]
    except OSError as e:
        raise SystemExit(f"cannot read the prompts in {data} ({e}); see ../shared/data/README.md, "
                         "or pass --data") from None
    return {"mt_bench": mt, "gsm8k": gsm, "humaneval": he}


def pick_conversation(prompts: dict[str, list], rng: random.Random) -> list[str]:
    kind = rng.choices(["mt_bench", "gsm8k", "humaneval"], [2, 1, 1])[0]
    turns = list(rng.choice(prompts[kind]))
    if rng.random() < (0.3 if kind == "mt_bench" else 0.5):
        turns.append(FOLLOW_UPS[kind])
    return turns
