"""A narrow task where a small drafter learns long acceptance in minutes on a CPU: counting.

Writes `train.jsonl` (chat records, {"messages": [...]}, for `dflash-mlx train`, whose
`--regenerate` replaces the replies with the target's own) and `heldout.jsonl` (prompts in
the benchmark's {"id", "prompt"} form, none of them in the training set) to OUT_DIR.
It exists to show `--block-size auto` with a drafter that pays (README, Benchmark); it is
not a useful drafter for anything else.

    python benchmarks/counting_task.py runs/counting
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

RANGE_TEMPLATES = [
    "Write the numbers from {a} to {b}, separated by commas.",
    "Count from {a} to {b}.",
    "List every integer from {a} to {b}, separated by commas.",
    "Please write out all the numbers between {a} and {b}, inclusive, separated by commas.",
    "Count up from {a} to {b}, one number at a time, separated by commas.",
    "Can you list the numbers {a} through {b}? Separate them with commas.",
    "I need the sequence of whole numbers from {a} to {b}, comma-separated.",
    "Write down the integers starting at {a} and ending at {b}, separated by commas.",
]
STEP_TEMPLATES = [
    "Write the numbers from {a} to {b} in steps of {s}, separated by commas.",
    "Count by {s}s from {a} to {b}.",
]
HELD_OUT = [
    "Write the numbers from 143 to 171, separated by commas.",
    "List every integer from 212 to 240, separated by commas.",
    "Can you list the numbers 7 through 38? Separate them with commas.",
    "Write down the integers starting at 63 and ending at 95, separated by commas.",
    "Please write out all the numbers between 121 and 150, inclusive, separated by commas.",
    "Count by 5s from 35 to 140.",
]


def example(rng: random.Random) -> tuple[str, str]:
    """One prompt and its exact reply (a comma-separated run of numbers)."""
    if rng.random() < 0.85:
        a = rng.choice([rng.randint(0, 99), rng.randint(1, 300)])
        b, step, templates = a + rng.randint(12, 34), 1, RANGE_TEMPLATES
    else:
        step = rng.choice([2, 5, 10])
        a = rng.randint(0, 40) * step
        b, templates = a + step * rng.randint(12, 25), STEP_TEMPLATES
    prompt = rng.choice(templates).format(a=a, b=b, s=step)
    return prompt, ", ".join(str(x) for x in range(a, b + 1, step)) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--examples", type=int, default=450)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    rng, held_out = random.Random(args.seed), set(HELD_OUT)
    rows: dict[str, str] = {}
    while len(rows) < args.examples:
        prompt, reply = example(rng)
        if prompt not in held_out:
            rows.setdefault(prompt, reply)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "train.jsonl", "w") as f:
        for prompt, reply in rows.items():
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    with open(args.out_dir / "heldout.jsonl", "w") as f:
        for i, prompt in enumerate(HELD_OUT):
            f.write(json.dumps({"id": f"count{i}", "prompt": prompt}) + "\n")
    print(f"{len(rows)} training examples, {len(HELD_OUT)} held-out prompts in {args.out_dir}")


if __name__ == "__main__":
    main()
