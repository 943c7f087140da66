"""`--block-size auto` against every fixed block size, in simulated regimes, side by side.

    python benchmarks/bench_policy.py [--replies 200 --max-tokens 64] [--noise 0.15 --slow 0.05] [--policy FILE.py ...]

Each regime is a cost per cycle (in plain-step units, by block size and context) and a
per-position acceptance (the chance that draft position k is accepted once reached).
Replies of `--max-tokens` tokens are decoded cycle by cycle, as the decode loop does
(a plain step promised ahead costs `AHEAD` of one in order), by a fresh uncalibrated
policy per reply ("fresh": a one-shot `generate`) and by one calibrated policy serving
every reply ("served": chat, serve, bench). Printed: tokens per unit time of each,
as a ratio to the best fixed size. `--noise` and `--slow` tell the policy each cycle's time as a
shared machine would (lognormal noise, now and then twice as slow); the time counted stays the regime's.
`--policy` adds another implementation (a file
defining `AutoBlockSize`, e.g. an older `mlx_dflash/auto/policy.py`) to compare with.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mlx_dflash.auto.policy import AutoBlockSize, candidate_sizes
from mlx_dflash.decoding.block_size import FixedBlockSize

AHEAD = 0.92  # a plain step launched before the last one is read, against one in order (CPU)


@dataclass
class Regime:
    name: str
    cost: Callable[[int, int], float]  # (block size, context position) -> plain-step units
    acceptance: Callable[[int, int], float]  # (draft position k >= 1, reply index) -> P(accepted | reached)
    max_block: int = 16
    context: int = 0  # the prompt's positions
    prefill: float = 0.0  # the prompt's prefill per position (plain-step units), told to the policy


def constant(p: float) -> Callable[[int, int], float]:
    return lambda k, reply: p


def falling(p1: float, drop: float) -> Callable[[int, int], float]:
    return lambda k, reply: max(p1 - drop * (k - 1), 0.0)


def mac(L: int, n: int) -> float:  # verify of L tokens: 1 + 0.015 L steps; a draft pass: 0.3
    return 1.0 if L == 1 else 1.0 + 0.015 * L + 0.3


def cpu(L: int, n: int) -> float:  # 2-core CPU, SmolLM2 float32, a 4-layer drafter (measured shape)
    return 1.0 if L == 1 else 1.14 + 0.045 * L + 0.6


def cpu_4k(L: int, n: int) -> float:  # the same at 4k tokens of context: a draft pass and wide verifies cost more
    return 1.0 if L == 1 else 1.3 + 0.2 * L + 0.6


def tiny(L: int, n: int) -> float:  # a tiny model: per-call overhead dominates, any verify costs about a step
    return 1.0 if L == 1 else 1.15 + 0.01 * L + 0.5


REGIMES = [
    Regime("mac, tau~6.5 at 16", mac, constant(0.86)),
    Regime("mac, falling acceptance", mac, falling(0.95, 0.02)),
    Regime("cpu, weak drafter", cpu, falling(0.35, 0.01)),
    Regime("cpu 4k, weak drafter", cpu_4k, falling(0.35, 0.01), context=4096, prefill=0.2),
    Regime("cpu, useless drafter", cpu, constant(0.0)),
    Regime("tiny, block 8 whole", tiny, constant(0.995), max_block=8),
    Regime("cpu, strong", cpu, constant(0.9)),
    Regime("alternating 0.95/0.1", cpu, lambda k, reply: 0.95 if reply % 2 else 0.1),
]


def decode_reply(policy, regime: Regime, reply: int, max_tokens: int, rng, noise: float = 0.0,
                 slow: float = 0.0) -> tuple[int, float]:
    """One reply through `policy`: (tokens, time in plain-step units). With `noise`, the policy is told each
    cycle's time x lognormal noise (and twice that for a share `slow` of cycles), as a shared machine shows it;
    the time counted is the regime's own."""
    try:
        policy.begin((regime.context, regime.prefill * regime.context))
    except TypeError:  # an older policy (`--policy`) that is not told of the prefill
        policy.begin()
    tokens, seconds, position, promised = 1, 0.0, regime.context, False
    while tokens < max_tokens:
        size = policy.choose(max_tokens - tokens, position)
        ahead = promised
        promised = size == 1 and max_tokens - tokens > 1 and policy.promise_plain()
        accepted = 0
        while accepted < size - 1 and rng.random() < regime.acceptance(accepted + 1, reply):
            accepted += 1
        cycle = regime.cost(size, position) * (AHEAD if ahead else 1.0)
        told = cycle * (rng.lognormal(0.0, noise) * (2.0 if rng.random() < slow else 1.0) if noise or slow else 1.0)
        policy.record(size, accepted, told)
        tokens += accepted + 1
        seconds += cycle
        position += accepted + 1
    return tokens, seconds


def calibration(regime: Regime) -> dict[int, tuple[float, float]]:
    return {L: (regime.cost(L, 0), 0.0) for L in candidate_sizes(regime.max_block)}


def rate(make_policy, regime: Regime, replies: int, max_tokens: int, fresh: bool, seed: int, noise: float = 0.0,
         slow: float = 0.0) -> float:
    rng = np.random.default_rng(seed)
    policy, tokens, seconds = make_policy(), 0, 0.0
    for reply in range(replies):
        if fresh:
            policy = make_policy()
        t, s = decode_reply(policy, regime, reply, max_tokens, rng, noise, slow)
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds


def load_policy(path: str):
    spec = importlib.util.spec_from_file_location(f"policy_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.AutoBlockSize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--policy", action="append", default=[], help="another AutoBlockSize to compare (a .py file)")
    parser.add_argument("--noise", type=float, default=0.0, help="lognormal sigma of the cycle times the policy sees")
    parser.add_argument("--slow", type=float, default=0.0, help="share of cycles the policy sees twice as slow")
    args = parser.parse_args()
    autos = {"auto": AutoBlockSize} | {f"auto[{p}]": load_policy(p) for p in args.policy}
    print(f"{args.replies} replies of {args.max_tokens} tokens, {args.seeds} seeds, timing noise {args.noise} "
          f"(slow cycles {args.slow}); ratios to the best fixed size")
    print(f"| regime | best fixed (tok/step) | {' | '.join(f'{n} fresh | {n} served' for n in autos)} |")
    print("|---|---|" + "---|---|" * len(autos))
    for regime in REGIMES:
        def mean_rate(factory, fresh, regime=regime):
            return np.mean([rate(factory, regime, args.replies, args.max_tokens, fresh, s, args.noise, args.slow)
                            for s in range(args.seeds)])

        fixed = {L: mean_rate(lambda L=L: FixedBlockSize(L), True) for L in candidate_sizes(regime.max_block)}
        best = max(fixed, key=fixed.get)
        cells = []
        for cls in autos.values():
            block, base = regime.max_block, calibration(regime)
            cells.append(mean_rate(lambda cls=cls, block=block: cls(block), True) / fixed[best])
            cells.append(mean_rate(lambda cls=cls, block=block, base=base: cls(block, base_costs=base), False)
                         / fixed[best])
        print(f"| {regime.name} | b{best} {fixed[best]:.2f} (b1 {fixed[1]:.2f}) | "
              + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
