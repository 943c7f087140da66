"""`auto` with no calibration and a new policy per request, against fixed sizes and the target alone.

    python benchmarks/bench_auto_fresh.py --data-dir ../shared/data [--q 0.0 --block 8 --prompts 10]

The case of a one-shot `generate()` through the Python API: nothing measured or remembered
beforehand. The proposer is the benchmark's oracle (the target's own greedy continuation,
each position wrong at rate `--q`), so that its strength is known; `--q 0` is a pair whose
blocks are accepted whole. Modes run interleaved on every prompt; each greedy output is
checked against the target alone's. Printed: pooled decode tok/s per mode and the ratios.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx_dflash

from mlx_dflash.bench.datasets import load_prompts
from mlx_dflash.bench.proposers import CorruptedGreedyFactory
from mlx_dflash.bench.runner import chat_ids
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
    args = parser.parse_args()

    model, tokenizer, _ = mlx_dflash.load(choose_pair(None, None).target)
    oracle = CorruptedGreedyFactory(model, tokenizer, args.q, block_size=args.block)
    modes = {"target": None, "auto": "auto", f"b{args.block}": args.block}
    totals = {m: [0, 0.0] for m in modes}
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p.turns[0]}], None)
               for p in load_prompts(args.dataset, args.data_dir, limit=args.prompts)]
    for r in range(args.rounds):
        for i, ids in enumerate(prompts):
            reference = None
            for mode in list(modes)[(i + r) % len(modes):] + list(modes)[: (i + r) % len(modes)]:
                proposer = oracle(ids, args.max_tokens) if modes[mode] is not None else None
                tokens, first = [], None
                for event in mlx_dflash.stream_generate(model, tokenizer, ids, draft_model=proposer,
                                                        max_tokens=args.max_tokens, block_size=modes[mode]):
                    first = first or time.perf_counter()
                    tokens += event.tokens
                totals[mode][0] += len(tokens) - 1
                totals[mode][1] += time.perf_counter() - first
                reference = reference or (mode, tokens)
                if tokens != reference[1]:
                    sys.exit(f"prompt {i}: {mode} differs from {reference[0]}")
    rates = {m: n / s for m, (n, s) in totals.items()}
    print(f"{machine()}; oracle q={args.q}, block {args.block}, {len(prompts)} prompts x {args.rounds} rounds, "
          f"{args.max_tokens} tokens; every output identical")
    for m, tps in rates.items():
        print(f"{m:>8}: {tps:6.1f} tok/s  {tps / rates['target']:.2f}x target  "
              f"{tps / rates[f'b{args.block}']:.2f}x b{args.block}")


if __name__ == "__main__":
    main()
