"""The draft pass of the default pair (or `--model`/`--draft`), timed: the whole pass (draft layers and
the target's LM head) and its draft layers alone, for each drafter dtype and block size, beside one
plain step of the target.

    python benchmarks/bench_draft_pass.py [--dtypes float32,bfloat16] [--blocks 2,4,8,16]

What a drafted cycle pays before its verify: where it is a large share of a plain step, a block
pays only where the drafter's first position is accepted often. Figures name the machine; nothing
here is a test.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash
import mlx.core as mx

from mlx_dflash.loading.resolve import choose_pair
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.dtypes import DTYPES
from mlx_dflash.targets.model import as_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402

PROMPT = "Explain how photosynthesis works in plants, step by step, for a student. " * 6


def milliseconds(compute, repeats: int) -> float:
    """The median of `repeats` timed evaluations of `compute()`, after three to warm up."""
    for _ in range(3):
        mx.eval(compute())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(compute())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_drafter(target, drafter, ids: mx.array, block: int, repeats: int) -> tuple[float, float]:
    """Milliseconds of a draft of `block` after the context `ids`: the whole pass, and its draft layers alone."""
    proposer = DFlashProposer(drafter, target, max_block_size=drafter.block_size)
    _, features = target.forward(ids, target.make_cache(), capture=drafter.target_layer_ids)
    proposer.commit(features, 0)
    mx.eval(proposer.state_arrays())
    position, last = ids.shape[1], ids[0, -1:]
    tokens = mx.concatenate([last.astype(mx.uint32), mx.full((block - 1,), drafter.mask_token_id, mx.uint32)])
    whole = milliseconds(lambda: proposer.propose(last, position, block), repeats)
    layers = milliseconds(lambda: drafter(target.embed(tokens[None]), proposer.cache, position), repeats)
    return whole, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--blocks", default="2,4,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    pair = choose_pair(args.model, args.draft)
    model, tokenizer, _ = mlx_dflash.load(pair.target)
    target = as_target(model)
    ids = mx.array(tokenizer.encode(PROMPT))[None]
    print(f"{machine()}; target {target.dtype}, a context of {ids.shape[1]} tokens, median of {args.repeats}")
    for name in args.dtypes.split(","):
        drafter = mlx_dflash.load_drafter(pair.draft, target, dtype=DTYPES[name])
        for block in [int(b) for b in args.blocks.split(",") if 1 < int(b) <= drafter.block_size]:
            whole, layers = time_drafter(target, drafter, ids, block, args.repeats)
            print(f"drafter {name:<8} block {block:>2}: pass {whole:6.1f} ms, its draft layers {layers:6.1f} ms")
    cache = target.make_cache()
    target.forward(ids[:, :-1], cache)
    mx.eval([c.state for c in cache])
    step = milliseconds(lambda: target.forward(ids[:, -1:], cache)[0], args.repeats)
    print(f"a plain step of the target (its context growing by one each time): {step:.1f} ms")


if __name__ == "__main__":
    main()
