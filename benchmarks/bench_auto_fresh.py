"""`auto` with no calibration and a new policy per request, against fixed sizes and the target alone.

    python benchmarks/bench_auto_fresh.py --data-dir ../shared/data [--q 0.0 --block 8 --prompts 10]
    python benchmarks/bench_auto_fresh.py --data-dir ../shared/data --drafter --context 4096 --prompts 3
    python benchmarks/bench_auto_fresh.py --model T --draft D --dataset counting/heldout.jsonl --prompts 6

The case of a one-shot `generate()` through the Python API: nothing measured or remembered
beforehand. The proposer is the benchmark's oracle (the target's own greedy continuation,
each position wrong at rate `--q`), so that its strength is known; `--q 0` is a pair whose
blocks are accepted whole. `--drafter` takes the default pair's shipped drafter instead (`--draft D`
another drafter, `--model T` another target), and `--context N` pads each prompt with the other
prompts' text to about N tokens (a long one-shot request). Modes: the target alone (no drafter,
no lookup), `lookup` (prompt lookup alone, under `auto`; left out with `--no-lookup`), `auto`,
`auto-whole` (`auto` verifying every linear draft whole: no confident-prefix cut) and the fixed
block. They run interleaved on every prompt; each greedy output is checked against the target
alone's. Printed: pooled decode tok/s per mode and the ratios.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx_dflash

from mlx_dflash.auto.policy import make_policy
from mlx_dflash.bench.datasets import load_prompts
from mlx_dflash.bench.proposers import CorruptedGreedyFactory
from mlx_dflash.bench.runner import chat_ids, filler_text
from mlx_dflash.loading.resolve import choose_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--q", type=float, default=0.0, help="oracle error rate per position")
    parser.add_argument("--block", type=int, default=8, help="the proposer's widest block")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafter", action="store_true", help="the shipped drafter instead of the oracle")
    parser.add_argument("--draft", default=None, help="this drafter instead of the oracle")
    parser.add_argument("--model", default=None, help="this target instead of the default pair's")
    parser.add_argument("--no-lookup", action="store_true", help="the drafter alone (prompt lookup off)")
    parser.add_argument("--context", type=int, default=0, help="pad each prompt to about this many tokens")
    parser.add_argument("--no-fixed", action="store_true", help="leave out the fixed block (slow at long contexts)")
    args = parser.parse_args()

    pair = choose_pair(None, None)
    model, tokenizer, _ = mlx_dflash.load(args.model or pair.target)
    if args.drafter or args.draft:
        drafter = mlx_dflash.load_drafter(args.draft or pair.draft)
        args.block = drafter.block_size

        def oracle(ids, max_tokens):
            return drafter
    else:
        oracle = CorruptedGreedyFactory(model, tokenizer, args.q, block_size=args.block)
    modes = {"target": 1, **({} if args.no_lookup else {"lookup": None}), "auto": "auto", "auto-whole": "auto",
             **({} if args.no_fixed else {f"b{args.block}": args.block})}
    totals = {m: [0, 0.0] for m in modes}
    texts = [p.turns[0] for p in load_prompts(args.dataset, args.data_dir, limit=args.prompts)]
    if args.context:
        texts = [filler_text(tokenizer, [o for o in texts if o != t] or texts, args.context) + "\n\n" + t
                 for t in texts]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": t}], None) for t in texts]
    for r in range(args.rounds):
        for i, ids in enumerate(prompts):
            reference = None
            for mode in list(modes)[(i + r) % len(modes):] + list(modes)[: (i + r) % len(modes)]:
                drafted = mode not in ("target", "lookup")
                proposer = oracle(ids, args.max_tokens) if drafted else None
                tokens, first = [], None
                policy = None
                if mode.startswith("auto"):  # as `stream_generate` makes it, uncalibrated
                    policy = make_policy("auto", args.block, None, drafter=True, lookup=not args.no_lookup)
                    policy.cut_drafts = mode == "auto"
                for event in mlx_dflash.stream_generate(model, tokenizer, ids, draft_model=proposer, policy=policy,
                                                        max_tokens=args.max_tokens, block_size=modes[mode],
                                                        prompt_lookup=mode != "target" and not args.no_lookup):
                    first = first or time.perf_counter()
                    tokens += event.tokens
                totals[mode][0] += len(tokens) - 1
                totals[mode][1] += time.perf_counter() - first
                reference = reference or (mode, tokens)
                if tokens != reference[1]:
                    sys.exit(f"prompt {i}: {mode} differs from {reference[0]}")
    rates = {m: n / s for m, (n, s) in totals.items()}
    proposer = args.draft or ("the shipped drafter" if args.drafter else f"oracle q={args.q}")
    print(f"{machine()}; {proposer}, block {args.block}, {len(prompts)} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens x {args.rounds} rounds, {args.max_tokens} tokens; every output identical")
    for m, tps in rates.items():
        print(f"{m:>10}: {tps:6.1f} tok/s  {tps / rates['target']:.2f}x target"
              + (f"  {tps / rates['lookup']:.2f}x lookup" if "lookup" in rates else "")
              + (f"  {tps / rates[f'b{args.block}']:.2f}x b{args.block}" if f"b{args.block}" in rates else ""))


if __name__ == "__main__":
    main()
