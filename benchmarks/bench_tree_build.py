"""What building a draft tree costs, apart from the verify: `top_candidates` and `build_tree` per budget.

The tree is built lazily inside a tree cycle's graph; this times that part alone, per budget
and shape, over a vocabulary the size of SmolLM2's, as the graph's construction (Python) and its
evaluation, side by side with the linear draft's argmax on the same logits. Names the machine.

    python benchmarks/bench_tree_build.py --depth 15 --vocab 49152 --repeats 50
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx

from mlx_dflash.decoding.tree import PAPER, SPINE, build_tree, top_candidates, tree_nodes


def time_one(build, repeats: int) -> tuple[float, float]:
    """Median (graph construction, evaluation) seconds of `build()` (which returns arrays to evaluate)."""
    built, evaluated = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        arrays = build()
        middle = time.perf_counter()
        mx.eval(*arrays)
        built.append(middle - start)
        evaluated.append(time.perf_counter() - middle)
    return sorted(built)[repeats // 2], sorted(evaluated)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--budgets", default="16,32,64")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, MLX {mx.__version__}, "
          f"device {mx.default_device()}")
    logits = mx.random.normal((args.depth, args.vocab)) * 3.0
    root = mx.array([1], dtype=mx.uint32)
    mx.eval(logits)
    graph, run = time_one(lambda: [mx.argmax(logits, axis=-1)], args.repeats)
    print(f"| tree | graph ms | eval ms |\n|---|---|---|\n| linear (argmax) | {graph * 1e3:.2f} | {run * 1e3:.2f} |")
    for shape in (SPINE, PAPER):
        for budget in (int(b) for b in args.budgets.split(",")):
            nodes = tree_nodes(budget, args.depth, shape)

            def build(nodes=nodes, shape=shape):
                logprobs, ids = top_candidates(logits, min(nodes, args.vocab))
                tree = build_tree(root, logprobs, ids, nodes, shape)
                return [tree.tokens, tree.parents, tree.visible, tree.depths]

            graph, run = time_one(build, args.repeats)
            print(f"| {shape} {budget} ({nodes} nodes) | {graph * 1e3:.2f} | {run * 1e3:.2f} |")


if __name__ == "__main__":
    main()
