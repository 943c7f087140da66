"""DFlash and the target alone on 1 rank and on N ranks (mlx.launch, ring over loopback), side by side.

    python benchmarks/bench_distributed.py [--model M] [--draft D] [--ranks 2] [--prompts 3] [--max-tokens 48]

Each configuration runs in its own launch (rank 0 reports); the table gives decode tok/s, tau and the
estimated communication per cycle (all-reduces per cycle x a measured all-reduce of that size) and its
share of the cycle. On one machine the ranks share its cores and memory bandwidth, so no speedup is
expected here: the point is the overhead and where it goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"


def worker(args: argparse.Namespace) -> None:
    import mlx_dflash
    from mlx_dflash.distributed import world
    from mlx_dflash.resolve import choose_pair
    from mlx_dflash.target import as_target

    pair = choose_pair(args.model, args.draft, no_draft=args.no_draft)
    model, tokenizer, drafter = mlx_dflash.load(pair.target, pair.draft)
    prompts = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: args.prompts]]
    tokens = seconds = 0.0
    lengths, sizes = [], []
    for i, question in enumerate(prompts + prompts[:1]):  # the first prompt again at the end: warm-up is run 0
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        events = list(mlx_dflash.stream_generate(model, tokenizer, ids, draft_model=drafter,
                                                 max_tokens=args.max_tokens, block_size=args.block_size))
        if i == 0:
            continue
        stats = events[-1].stats
        tokens += max(stats.num_tokens - 1, 0)
        seconds += stats.decode_time
        lengths += stats.acceptance_lengths
        sizes += stats.block_sizes
    w = world()
    target = as_target(model)
    rows = max(1, round(sum(sizes) / max(len(sizes), 1)))
    comm = w.cycle_comm_ms(target.num_layers, rows, target.hidden_size) if w is not None else 0.0
    cycle_ms = 1000 * seconds / max(len(lengths), 1)
    if w is None or w.is_main:
        print("RESULT " + json.dumps({
            "ranks": 1 if w is None else w.size, "draft": drafter is not None, "tok_s": tokens / seconds,
            "tau": sum(lengths) / max(len(lengths), 1), "cycle_ms": cycle_ms, "comm_ms": comm,
        }), flush=True)


def run(args: argparse.Namespace, ranks: int, no_draft: bool) -> dict:
    me = [sys.executable, __file__, "--worker", "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
          "--block-size", str(args.block_size), *(["--model", args.model] if args.model else []),
          *(["--draft", args.draft] if args.draft else []), *(["--no-draft"] if no_draft else [])]
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    command = me if ranks == 1 else [launch, "-n", str(ranks), "--backend", "ring", *me]
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"no result from {' '.join(command)}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--draft")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--block-size", default="auto")
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block_size.isdigit():
        args.block_size = int(args.block_size)
    if args.worker:
        return worker(args)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}, "
          f"python {platform.python_version()}; ranks share this one machine (loopback ring)")
    print(f"{'ranks':>5} {'mode':<12} {'tok/s':>7} {'tau':>5} {'cycle ms':>9} {'comm ms':>8} {'comm share':>10}")
    for no_draft in (True, False):
        for ranks in (1, args.ranks):
            started = time.perf_counter()
            r = run(args, ranks, no_draft)
            share = r["comm_ms"] / r["cycle_ms"] if r["cycle_ms"] else 0.0
            mode = "target alone" if no_draft else "DFlash"
            print(f"{r['ranks']:>5} {mode:<12} {r['tok_s']:>7.2f} {r['tau']:>5.2f} {r['cycle_ms']:>9.1f} "
                  f"{r['comm_ms']:>8.1f} {share:>10.0%}   ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
