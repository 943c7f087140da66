"""`auto` replayed on recorded drafts: per prompt, against every fixed size, over many timing draws.

    python benchmarks/bench_auto_replay.py record --out runs/replay-fixture.json     # the tree fixture
    python benchmarks/bench_auto_replay.py record --pair --data-dir ../shared/data --out runs/replay-pair.json
    python benchmarks/bench_auto_replay.py replay runs/replay-fixture.json [--seeds 20 --noise 0.15]

On a shared machine a run's timing is noisier than what the policy's choices change, and one
run shows one draw of it. `record` decodes each prompt greedily with the drafter alone (prompt
lookup off) and, at every position, drafts with each candidate block size, keeping how many of
its tokens the target accepts there and the drafter's confidence in each (a block's draft
depends on its size: a block of 4 is not the first 3 positions of a block of 8); it also
measures each fixed size's quiet cost per cycle (the fastest of one run per prompt, the sizes
taking turns). The prompts: the trained tiny fixture's (`tree_fixture.py`), or with `--pair`
the default pair's on GSM8K. `replay` drives a fresh uncalibrated `auto` policy (a one-shot
`generate`) through each prompt, cycle by cycle as the decode loop does, each cycle's time drawn
from those costs (lognormal noise, and now and then a cycle twice as slow), and prints per prompt
its modelled tokens per second against every fixed size's (block 1: the target alone), over
`--seeds` draws, with the worst draw's cycles.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import mlx_dflash
import mlx.core as mx

from mlx_dflash.auto.policy import AUTO, candidate_sizes, make_policy
from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.proposers.base import DFLASH
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.targets.model import as_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402
from bench_tree import trace as fold  # noqa: E402


class Recorder:
    """The session's proposer, drafting every candidate size at each position it is first asked at."""

    def __init__(self, inner, sizes: list[int], store: dict):
        self.inner, self.sizes, self.store = inner, sizes, store

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_logits(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        if position not in self.store:
            drafts = {}
            for size in self.sizes:
                logits = self.inner.draft_logits(last_token, position, size).astype(mx.float32)
                tokens, confidence = mx.argmax(logits, axis=-1), mx.max(mx.softmax(logits, axis=-1), axis=-1)
                mx.eval(tokens, confidence)
                drafts[size] = (tokens.tolist(), confidence.tolist())
            self.store[position] = drafts
        return self.inner.draft_logits(last_token, position, block_size)

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        return mx.argmax(self.draft_logits(last_token, position, block_size), axis=-1).astype(mx.uint32)


class Wander(FixedBlockSize):
    """Blocks of 1 or 2 at random: a drafted cycle at most positions, whatever is accepted."""

    def __init__(self, rng: random.Random):
        super().__init__(2)
        self.rng = rng

    def choose(self, limit: int, position: int, offers: dict | None = None) -> int:
        return min(limit, self.rng.choice((1, 2, 2)))


def record(args) -> None:
    if args.pair:
        from mlx_dflash.bench.datasets import load_prompts
        from mlx_dflash.bench.runner import chat_ids
        from mlx_dflash.loading.resolve import choose_pair

        pair = choose_pair(None, None)
        model, tokenizer, _ = mlx_dflash.load(pair.target)
        drafter = mlx_dflash.load_drafter(pair.draft)
        texts = [p.turns[0] for p in load_prompts(args.dataset, args.data_dir, limit=args.prompts)]
        prompts = [(f"{args.dataset}{i}", chat_ids(tokenizer, [{"role": "user", "content": t}], None))
                   for i, t in enumerate(texts)]
    else:
        import tree_fixture

        model, tokenizer, drafter, fixture = tree_fixture.load(tree_fixture.build(tree_fixture.DEFAULT_DIR))
        prompts = [(p["id"], p["ids"]) for p in fixture[: args.prompts]]
    target, block = as_target(model), drafter.block_size
    sizes = candidate_sizes(block)[1:]

    def generate(ids, policy, proposer=None):
        tokens, stats = [], None
        for event in mlx_dflash.stream_generate(model, tokenizer, ids, draft_model=proposer or drafter,
                                                max_tokens=args.max_tokens, policy=policy, prompt_lookup=False):
            tokens, stats = tokens + event.tokens, event.stats
        return tokens, stats

    out = {"machine": machine(), "max_tokens": args.max_tokens, "sizes": sizes, "prompts": []}
    for name, ids in prompts:
        reference, _ = generate(ids, FixedBlockSize(block))
        text, store, rng = list(ids) + reference, {}, random.Random(0)
        for _ in range(8):  # until every position was drafted at (a few runs)
            assert generate(ids, Wander(rng), Recorder(make_proposer(target, drafter, block), sizes, store))[0] \
                == reference, f"{name}: not the target's own output"
            if set(range(len(ids), len(ids) + args.max_tokens - 1)) <= set(store):
                break
        rows = {}
        for position, drafts in store.items():
            rows[position] = {size: {"accepted": next((i for i, t in enumerate(tokens)
                                                       if position + 1 + i >= len(text) or t != text[position + 1 + i]),
                                                      len(tokens)),
                                     "confidence": confidence}
                              for size, (tokens, confidence) in drafts.items()}
        out["prompts"].append({"id": name, "start": len(ids), "rows": rows})
        print(f"{name}: {len(rows)} positions drafted", file=sys.stderr, flush=True)
    costs = {}
    for _, ids in prompts:
        for size in [1, *sizes]:
            tokens, stats = generate(ids, FixedBlockSize(size))
            seconds = (len(tokens) - 1) / stats.generation_tps / stats.cycles
            costs[size] = min(costs.get(size, seconds), seconds)
    out["costs"] = costs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out) + "\n")
    print(f"saved {args.out}; seconds per cycle: " + ", ".join(f"b{k} {v * 1e3:.2f} ms" for k, v in costs.items()))


class Replay:
    """One recorded prompt: what a cycle of each size at each position would commit, and what it costs."""

    def __init__(self, prompt: dict, costs: dict[int, float], sizes: list[int], max_tokens: int):
        self.prompt, self.sizes, self.max_tokens = prompt, sizes, max_tokens
        self.costs = {L: costs.get(L) or self._between(costs, L) for L in range(1, max(sizes) + 1)}

    @staticmethod
    def _between(costs: dict[int, float], size: int) -> float:
        below, above = max(k for k in costs if k < size), min(k for k in costs if k > size)
        return costs[below] + (costs[above] - costs[below]) * (size - below) / (above - below)

    def draft(self, position: int, size: int) -> tuple[int, list[float]]:
        """Draft tokens accepted and the confidences of a block of `size` (a size not recorded: the next one's
        draft cut short); a position never drafted at counts as rejected."""
        row = self.prompt["rows"].get(str(position))
        recorded = min(L for L in self.sizes if L >= size)
        if row is None:
            return 0, [0.0] * (size - 1)
        draft = row[str(recorded)]
        return min(draft["accepted"], size - 1), draft["confidence"][: size - 1]

    def decode(self, policy, rng: random.Random | None = None, noise: float = 0.0, slow: float = 0.0):
        """(modelled seconds, cycles as (block size, tokens kept)) of one reply decoded by `policy`."""
        position, left, seconds, cycles = self.prompt["start"], self.max_tokens - 1, 0.0, []
        policy.begin((self.prompt["start"], 0.0))
        while left > 0:
            size = policy.choose(left, position, {DFLASH: max(self.sizes) - 1})
            accepted = 0
            if size > 1:
                accepted, confidence = self.draft(position, size)
                if size > 2 and policy.confident:
                    size = min(max(policy.cut(confidence), 2), size)
                    accepted = min(accepted, size - 1)
            elif left > 1:
                policy.promise_plain()
            drawn = self.costs[size] * (rng.lognormvariate(0.0, noise) * (2.0 if rng.random() < slow else 1.0)
                                        if rng else 1.0)
            policy.record(size, accepted, drawn)
            kept = min(accepted + 1, left)
            seconds, position, left = seconds + self.costs[size], position + kept, left - kept
            cycles.append((size, kept))
        return seconds, cycles


def trace(cycles: list[tuple[int, int]]) -> str:
    """Cycles as block size:tokens kept, runs of plain steps folded (`bench_tree.trace`)."""
    return fold({"block_sizes": [size for size, _ in cycles], "lengths": [kept for _, kept in cycles],
                 "tree_sizes": []})


def replay(args) -> None:
    data = json.loads(args.recording.read_text())
    sizes, tokens = data["sizes"], data["max_tokens"] - 1
    costs = {int(k): v for k, v in data["costs"].items()}
    print(f"{args.recording}: recorded on {data['machine']}; replayed with {args.seeds} timing draws "
          f"(noise {args.noise}, slow cycles {args.slow}), a fresh uncalibrated `auto` per reply")
    print("modelled tok/s of each fixed size; auto / the best fixed size: mean, worst draw")
    ratios = []
    for prompt in data["prompts"]:
        run = Replay(prompt, costs, sizes, data["max_tokens"])
        fixed = {L: tokens / run.decode(FixedBlockSize(L))[0] for L in [1, *sizes]}
        best = max(fixed.values())
        draws = []
        for seed in range(args.seeds):
            seconds, cycles = run.decode(make_policy(AUTO, max(sizes), None, drafter=True), random.Random(seed),
                                         args.noise, args.slow)
            draws.append((tokens / seconds / best, cycles))
        ratios += [r for r, _ in draws]
        worst = min(draws, key=lambda d: d[0])
        print(f"{prompt['id']:<8} " + " ".join(f"b{L} {v:6.0f}" for L, v in fixed.items())
              + f"  auto {statistics.mean(r for r, _ in draws):.2f} (worst {worst[0]:.2f}: {trace(worst[1])})")
    below = sum(r < 0.9 for r in ratios) / len(ratios)
    print(f"pooled: auto / best fixed {statistics.mean(ratios):.3f}; draws below 0.9x: {below:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="record drafts and costs")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--pair", action="store_true", help="the default pair on --dataset instead of the tree fixture")
    rec.add_argument("--data-dir", type=Path, default=None)
    rec.add_argument("--dataset", default="gsm8k")
    rec.add_argument("--prompts", type=int, default=10)
    rec.add_argument("--max-tokens", type=int, default=64)
    rep = commands.add_parser("replay", help="replay `auto` on a recording")
    rep.add_argument("recording", type=Path)
    rep.add_argument("--seeds", type=int, default=20)
    rep.add_argument("--noise", type=float, default=0.15, help="lognormal sigma of each cycle's time")
    rep.add_argument("--slow", type=float, default=0.05, help="share of cycles taking twice their time")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
