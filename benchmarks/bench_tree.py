"""Draft trees and `--block-size auto` on the trained tiny fixture: tau and tokens/s per mode, per prompt.

    python benchmarks/tree_fixture.py                      # once: builds the fixture (a few CPU minutes)
    python benchmarks/bench_tree.py [--fixture DIR] [--rounds 3] [--max-tokens 64] [--json PATH]

The fixture (`tree_fixture.py`) is a tiny llama target and a briefly trained DFlash drafter
(block 8) whose blocks are mostly accepted but whose probabilities are spread thin, with
"bad patches" where it is mostly wrong. On each of its 10 held-out prompts, greedy, the
drafter alone (prompt lookup off), this runs:

    b8               fixed block 8, linear
    b8-spineN        fixed block 8 verified as a draft tree of N nodes, "spine" shape (N = 16, 32, 64)
    b8-paperN        the same, "paper" shape
    auto             `--block-size auto`, no calibration, trees off (a fresh policy per run)
    auto-nocut       `auto` verifying every linear draft whole (no confident-prefix cut)
    auto-trees       `--block-size auto --tree-budget auto`, no calibration

Modes run in a rotated order on every prompt, `--rounds` times; every output is checked
against b8's token for token. Printed: per prompt, tau and decode tok/s of every mode (the
median over rounds, or with `--stat best` the fastest round, steadier on a busy machine),
auto / best fixed mode, auto / b8, auto-trees / auto, each also "modelled" (every cycle priced
at the fastest per-cycle time of its kind seen here, so that a busy machine's noise does not
decide the ratios; the policies' choices still follow the timings they saw), and the plain
steps (cycles of block size 1; a last cycle with one token of budget left counts too) auto
took; then the pooled figures and the prompts where auto falls below 0.9x the best fixed mode,
with its cycles there (block size:tokens committed, tN: a tree of N nodes, 1xN: N plain steps).
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import mlx_dflash
import mlx.core as mx

from mlx_dflash.auto.policy import AUTO, make_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree_fixture  # noqa: E402
from bench_cycle import machine  # noqa: E402

BLOCK = 8
BUDGETS = (16, 32, 64)
SHAPES = ("spine", "paper")


def policies() -> dict:
    """Mode name -> a function making a fresh policy for one generation."""
    modes = {"b8": lambda: make_policy(BLOCK, BLOCK, None, drafter=True, lookup=False, tree_budget=0)}
    for shape in SHAPES:
        for budget in BUDGETS:
            modes[f"b8-{shape}{budget}"] = (lambda b=budget, s=shape: make_policy(
                BLOCK, BLOCK, None, drafter=True, lookup=False, tree_budget=b, tree_shape=s))
    modes["auto"] = lambda: make_policy(AUTO, BLOCK, None, drafter=True, lookup=False, tree_budget=0)
    modes["auto-nocut"] = lambda: uncut(make_policy(AUTO, BLOCK, None, drafter=True, lookup=False, tree_budget=0))
    modes["auto-trees"] = lambda: make_policy(AUTO, BLOCK, None, drafter=True, lookup=False, tree_budget=AUTO)
    return modes


def uncut(policy):
    """`policy` verifying every linear draft whole (no confident prefix)."""
    policy.cut_drafts = False
    return policy


def run(model, tokenizer, drafter, ids: list[int], policy, max_tokens: int) -> dict:
    tokens, stats = [], None
    for event in mlx_dflash.stream_generate(model, tokenizer, ids, draft_model=drafter, max_tokens=max_tokens,
                                            policy=policy, prompt_lookup=False):
        tokens += event.tokens
        stats = event.stats
    longest = streak = 0
    for size in stats.block_sizes:
        streak = streak + 1 if size == 1 else 0
        longest = max(longest, streak)
    return {"tokens": tokens, "tau": stats.tau, "longest_plain": longest, "tps": stats.generation_tps,
            "cycles": stats.cycles,
            "plain": stats.plain_cycles, "block_sizes": list(stats.block_sizes),
            "lengths": list(stats.acceptance_lengths), "tree_sizes": list(getattr(stats, "tree_sizes", []))}


def per_cycle(r: dict) -> float:
    """A run's decode seconds per cycle."""
    return (len(r["tokens"]) - 1) / r["tps"] / max(r["cycles"], 1) if r["tps"] else float("inf")


def linear_costs(model, tokenizer, drafter, prompts: list[list[int]], max_tokens: int,
                 block_price: float) -> dict[int, float]:
    """Seconds per cycle of fixed linear blocks 1..BLOCK on this machine: the fastest of one run per prompt
    of each measured size, the sizes taking turns on each prompt so that a busy spell of the machine
    does not price one size alone (`block_price`: BLOCK's, measured so already), the others interpolated."""
    measured = {BLOCK: block_price}
    policy = {"drafter": True, "lookup": False, "tree_budget": 0}
    for ids in prompts:
        for size in (1, 2, 3, 4, 6):
            fixed = make_policy(size, BLOCK, None, **policy)
            seconds = per_cycle(run(model, tokenizer, drafter, ids, fixed, max_tokens))
            measured[size] = min(measured.get(size, seconds), seconds)
    costs, sizes = {}, sorted(measured)
    for size in range(1, BLOCK + 1):
        lo = max(s for s in sizes if s <= size)
        hi = min(s for s in sizes if s >= size)
        costs[size] = measured[lo] if lo == hi else (
            measured[lo] + (measured[hi] - measured[lo]) * (size - lo) / (hi - lo))
    return costs


def modelled_seconds(r: dict, linear: dict[int, float], trees: dict[int, float], tree_budget: int = 0) -> float:
    """A run's decode time with every cycle priced at the machine's quiet cost of its kind: a linear block by
    its size, a tree by the measured budget nearest its node count (`tree_budget`: every cycle is one)."""
    sizes = r["tree_sizes"] or [0] * len(r["block_sizes"])
    total = 0.0
    for size, nodes in zip(r["block_sizes"], sizes, strict=False):
        if tree_budget and size > 1:
            total += trees[tree_budget]
        elif nodes and trees:
            total += trees[min(trees, key=lambda b: abs(b - nodes))]
        else:
            total += linear[max(1, min(size, BLOCK))]
    return total


def trace(r: dict) -> str:
    """Cycles as block size:tokens committed (tN: a tree of N nodes), runs of plain steps folded."""
    out, plain = [], 0
    trees = r["tree_sizes"] or [0] * len(r["block_sizes"])
    for size, n, tree in zip(r["block_sizes"], r["lengths"], trees, strict=False):
        if size == 1:
            plain += 1
            continue
        if plain:
            out.append(f"1x{plain}")
            plain = 0
        out.append(f"{size}{f't{tree}' if tree else ''}:{n}")
    if plain:
        out.append(f"1x{plain}")
    return " ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=tree_fixture.DEFAULT_DIR,
                        help="the fixture's directory (built there first if missing)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=tree_fixture.GEN_TOKENS)
    parser.add_argument("--stat", choices=("median", "best"), default="median",
                        help="tok/s per prompt and mode over the rounds: the median, or the best (on a busy machine)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of the modes (b8 is always run)")
    parser.add_argument("--json", type=Path, default=None, help="save the results here")
    args = parser.parse_args()

    root = tree_fixture.build(args.fixture, log=lambda m: print(m, file=sys.stderr, flush=True))
    model, tokenizer, drafter, prompts = tree_fixture.load(root)
    modes = policies()
    if args.modes:
        wanted = {"b8", *args.modes.split(",")}
        unknown = wanted - set(modes)
        if unknown:
            sys.exit(f"unknown modes: {', '.join(sorted(unknown))} (known: {', '.join(modes)})")
        modes = {m: f for m, f in modes.items() if m in wanted}
    names = list(modes)
    fixed = [m for m in names if m.startswith("b8")]

    # Warm-up: every mode once on the first prompt (not timed).
    for m in names:
        run(model, tokenizer, drafter, prompts[0]["ids"], modes[m](), args.max_tokens)

    results = {p["id"]: {m: [] for m in names} for p in prompts}
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            k = (i + r) % len(names)
            for m in names[k:] + names[:k]:
                out = run(model, tokenizer, drafter, p["ids"], modes[m](), args.max_tokens)
                results[p["id"]][m].append(out)
            reference = results[p["id"]]["b8"][0]["tokens"]  # the first round's
            for m in names:
                assert results[p["id"]][m][-1]["tokens"] == reference, f"{p['id']}: {m} differs from b8"

    # Quiet prices per cycle, each the fastest of one run per prompt: fixed linear sizes (b8 from the
    # first round, the others measured now) and trees from the first round of their fixed-budget runs
    # (spine: what auto-trees builds). Modelled tok/s prices each run's cycles at them, so that a
    # comparison of the policies' choices is not at the mercy of a busy machine's noise.
    def price(m: str) -> float:
        return min(per_cycle(results[pid][m][0]) for pid in results)

    linear = linear_costs(model, tokenizer, drafter, [p["ids"] for p in prompts], args.max_tokens, price("b8"))
    tree_cost = {(shape, b): price(f"b8-{shape}{b}") for shape in SHAPES for b in BUDGETS if f"b8-{shape}{b}" in names}
    spine = {b: c for (shape, b), c in tree_cost.items() if shape == "spine"}

    def modelled(pid: str, m: str) -> float:
        """Modelled tok/s (the mean over rounds)."""
        budget, shape = 0, "spine"
        if m.startswith("b8-"):
            shape = "spine" if "spine" in m else "paper"
            budget = int(m.removeprefix(f"b8-{shape}"))
        trees = {b: c for (sh, b), c in tree_cost.items() if sh == shape} if budget else spine
        return statistics.mean((len(o["tokens"]) - 1) / modelled_seconds(o, linear, trees, budget)
                               for o in results[pid][m])

    def tps(pid: str, m: str) -> float:
        rates = [o["tps"] for o in results[pid][m]]
        return max(rates) if args.stat == "best" else statistics.median(rates)

    def tau(pid: str, m: str) -> float:
        return statistics.mean(o["tau"] for o in results[pid][m])

    def plain(pid: str, m: str) -> float:
        return statistics.mean(o["plain"] for o in results[pid][m])

    def longest(pid: str, m: str) -> int:
        return max(o["longest_plain"] for o in results[pid][m])

    print(f"{machine()}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"mlx {mx.__version__}, mlx-dflash {mlx_dflash.__version__}")
    print(f"fixture {root}; {len(prompts)} prompts x {args.rounds} rounds, {args.max_tokens} tokens, greedy, "
          f"drafter alone (prompt lookup off), block {BLOCK}; every output identical to b8's")
    print()
    short = {m: m.replace("spine", "s").replace("paper", "p") for m in names}
    head = "prompt " + " ".join(f"{short[m]:>14}" for m in names)
    print(f"tau / tok/s per mode ({args.stat} over rounds)")
    print(head)
    rows = []
    for p in prompts:
        pid = p["id"]
        print(f"{pid:<6} " + " ".join(f"{tau(pid, m):5.2f} /{tps(pid, m):6.1f}" for m in names))
        best = max(fixed, key=lambda m: tps(pid, m))
        best_modelled = max(fixed, key=lambda m: modelled(pid, m))
        row = {"id": pid, "best_fixed": best, "best_fixed_tps": tps(pid, best), "best_fixed_modelled": best_modelled,
               "modelled_tps": {m: modelled(pid, m) for m in names}}
        if "auto" in names:
            row.update(auto_vs_best=tps(pid, "auto") / tps(pid, best), auto_vs_b8=tps(pid, "auto") / tps(pid, "b8"),
                       auto_vs_best_modelled=modelled(pid, "auto") / modelled(pid, best_modelled),
                       auto_plain=plain(pid, "auto"), auto_longest_plain=longest(pid, "auto"))
        if "auto-trees" in names:
            row.update(auto_trees_plain=plain(pid, "auto-trees"), auto_trees_longest_plain=longest(pid, "auto-trees"))
            if "auto" in names:
                row["trees_vs_auto"] = tps(pid, "auto-trees") / tps(pid, "auto")
        rows.append(row)
    if "auto" in names:
        print()
        print("ratios of tok/s: measured (the table above), and modelled: every cycle priced at its kind's quiet")
        prices = [f"b{k} {v * 1e3:.2f}" for k, v in linear.items() if k in (1, 2, 4, 8)]
        prices += [f"{sh}{b} {c * 1e3:.2f}" for (sh, b), c in tree_cost.items()]
        print(f"cost here (ms per cycle: {', '.join(prices)})")
        print("plain steps: the mean per run (the longest stretch of consecutive ones in any round)")
        print(f"{'':7} {'measured':-^48}  {'modelled':-^37}  {'plain steps':-^20}")
        print(f"{'prompt':<7} {'best fixed':<14} {'auto/best':>9} {'auto/b8':>8} {'trees/auto':>11}  "
              f"{'best fixed':<14} {'auto/best':>9} {'trees/auto':>11}  {'auto':>9} {'auto-trees':>10}")
        for row in rows:
            m = row["modelled_tps"]
            trees = f"{row['trees_vs_auto']:11.2f}" if "trees_vs_auto" in row else f"{'-':>11}"
            trees_m = f"{m['auto-trees'] / m['auto']:11.2f}" if "auto-trees" in m else f"{'-':>11}"
            tplain = (f"{row['auto_trees_plain']:5.1f} ({row['auto_trees_longest_plain']:2d})"
                      if "auto_trees_plain" in row else f"{'-':>10}")
            print(f"{row['id']:<7} {row['best_fixed']:<14} {row['auto_vs_best']:9.2f} {row['auto_vs_b8']:8.2f} "
                  f"{trees}  "
                  f"{row['best_fixed_modelled']:<14} {row['auto_vs_best_modelled']:9.2f} {trees_m}  "
                  f"{row['auto_plain']:4.1f} ({row['auto_longest_plain']:2d}) {tplain}")
    pooled = {}
    for m in names:
        runs = [o for pid in results for o in results[pid][m]]
        n = sum(len(o["tokens"]) - 1 for o in runs)
        seconds = sum((len(o["tokens"]) - 1) / o["tps"] for o in runs if o["tps"])
        pooled[m] = {"tps": n / seconds, "tau": sum(sum(o["lengths"]) for o in runs) / sum(o["cycles"] for o in runs),
                     "plain": sum(o["plain"] for o in runs) / args.rounds,
                     "modelled_tps": statistics.mean(row["modelled_tps"][m] for row in rows)}
    print()
    print("pooled (measured tok/s, modelled tok/s, tau, plain steps per round):")
    for m in names:
        print(f"  {m:<12} {pooled[m]['tps']:7.1f} {pooled[m]['modelled_tps']:7.1f} {pooled[m]['tau']:5.2f} "
              f"{pooled[m]['plain']:5.1f}")
    if "auto" in names:
        slow = [row for row in rows if row["auto_vs_best"] < 0.9]
        there = ", ".join(f"{row['id']} {row['auto_plain']:.1f} (longest stretch {row['auto_longest_plain']})"
                          for row in slow)
        print(f"auto below 0.9x the best fixed mode on {len(slow)}/{len(rows)} prompts (measured)"
              + (f"; auto's plain steps there (mean over rounds): {there}" if slow else ""))
        slow_m = [row for row in rows if row["auto_vs_best_modelled"] < 0.9]
        there = ", ".join(f"{row['id']} {row['auto_plain']:.1f} (longest stretch {row['auto_longest_plain']})"
                          for row in slow_m)
        print(f"auto below 0.9x the best fixed mode on {len(slow_m)}/{len(rows)} prompts (modelled)"
              + (f"; auto's plain steps there (mean over rounds): {there}" if slow_m else ""))
        slow = sorted({row["id"]: row for row in slow + slow_m}.values(), key=lambda row: row["id"])
        for row in slow:
            for j, o in enumerate(results[row["id"]]["auto"]):
                print(f"  {row['id']} auto, round {j + 1}: {o['tps']:6.1f} tok/s  {trace(o)}")
            b8 = results[row["id"]]["b8"][-1]
            print(f"  {row['id']} b8:            {tps(row['id'], 'b8'):6.1f} tok/s  {trace(b8)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "mlx": mx.__version__, "fixture": str(root), "rounds": args.rounds, "stat": args.stat,
            "max_tokens": args.max_tokens,
            "modes": names, "per_prompt": rows, "pooled": pooled,
            "cycle_seconds": {"linear": linear, "trees": {f"{sh}{b}": c for (sh, b), c in tree_cost.items()}},
            "runs": {pid: {m: [{k: v for k, v in o.items() if k != "tokens"} for o in runs]
                           for m, runs in per.items()} for pid, per in results.items()},
        }, indent=2) + "\n")
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
