"""Decode speed at a long context: block-size modes against the target alone, many paired rounds.

    python benchmarks/bench_long_context.py --data-dir ../shared/data [--context 4096 --rounds 20]

`dflash-mlx bench --context 4k` prefills every run from scratch, so on a CPU a run is
mostly prefill and a handful of runs takes half an hour, too few to tell 3% from run-to-run
noise (~7% here). This benchmark prefills each prompt once per session (one with the drafter,
shared by its block-size modes, one without), then decodes `--max-tokens` from there in every
mode, round after round, rolling the sessions back after each run. The modes take turns in a
rotating order; an `auto` policy serves all its runs, as in a chat. Greedy, and every mode's
output is checked against the target alone's. Printed: each mode's pooled decode tok/s and its
ratio to the target alone over paired runs, with a 90% bootstrap interval (`bench.stats`).
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import mlx_dflash

from mlx_dflash.bench.runner import Record, chat_ids, first_mismatch, padded_text
from mlx_dflash.bench.datasets import load_prompts
from mlx_dflash.bench.stats import decode_tps, paired_ratio
from mlx_dflash.auto.calibration import calibrate
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.auto.policy import AUTO, make_policy, parse_block_size
from mlx_dflash.loading.resolve import choose_pair
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.targets.model import TargetModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402

TARGET = "target"


def decode(session: DecodingSession, ids: list[int], policy, max_tokens: int,
           tokenizer) -> tuple[list[int], float, Counter]:
    """Decode from the prefilled prompt, then roll the session back to it: (tokens, decode seconds,
    cycles per block size)."""
    tokens, first, event = [], None, None
    for event in stream_session(session, ids[-1:], make_sampler(0.0), max_tokens=max_tokens,
                                stop=set(tokenizer.eos_token_ids), detokenizer=tokenizer.detokenizer, policy=policy):
        first = first or time.perf_counter()
        tokens += event.tokens
    seconds = time.perf_counter() - first
    session.truncate(len(ids) - 1)
    return tokens, seconds, Counter(event.stats.block_sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded SmolLM2 and its drafter)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--data-dir", type=Path, default=None, help="local dataset copies (default: the Hub)")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--limit", type=int, default=1, help="prompts (each prefilled once per session)")
    parser.add_argument("--context", type=int, default=4096, help="tokens of context before the prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=20, help="runs of every mode per prompt")
    parser.add_argument("--block-size", default="auto,1", help="comma-separated modes with the drafter")
    args = parser.parse_args()

    choice = choose_pair(args.model, args.draft)
    model, tokenizer, drafter = mlx_dflash.load(choice.target, choice.draft)
    if drafter is None:
        sys.exit("needs a drafter (--draft)")
    target = TargetModel(model)
    sizes = [parse_block_size(s) for s in args.block_size.split(",")]
    calibration = calibrate(model, drafter)[0] if AUTO in sizes else None
    policies = {s: make_policy(s, drafter.block_size, calibration) for s in sizes}  # one per mode, kept
    names = [TARGET] + [f"dflash-{s if s == AUTO else f'b{s}'}" for s in sizes]
    prompts = load_prompts(args.dataset, args.data_dir, limit=args.limit)
    pool = [p.turns[0] for p in prompts]
    records: dict[str, list[Record]] = {name: [] for name in names}
    sizes_used: dict[str, Counter] = {name: Counter() for name in names}
    failures = 0
    print(f"machine: {machine()}")
    print(f"{choice.target} + {choice.draft}, context {args.context}, {args.max_tokens} tokens, {args.rounds} rounds")
    for prompt in prompts:
        text = padded_text(tokenizer, prompt, args.context, pool, None)
        ids = chat_ids(tokenizer, [{"role": "user", "content": text}], None)
        sessions = {TARGET: DecodingSession(target, None),
                    "drafter": DecodingSession(target, make_proposer(target, drafter, drafter.block_size))}
        for session in sessions.values():  # the shared prefill: everything but the last prompt token
            session.extend(ids[:-1], make_sampler(0.0))
            session.truncate(len(ids) - 1)
        decode(sessions["drafter"], ids, policies[sizes[0]], 8, tokenizer)  # warm up (allocations)
        decode(sessions[TARGET], ids, None, 8, tokenizer)
        for rounds in range(args.rounds):
            shift = rounds % len(names)
            outputs, mixed = {}, {}
            for name in names[shift:] + names[:shift]:
                size = None if name == TARGET else sizes[names.index(name) - 1]
                session = sessions[TARGET if size is None else "drafter"]
                outputs[name], seconds, cycles = decode(session, ids, policies.get(size), args.max_tokens, tokenizer)
                sizes_used[name] += cycles
                mixed[name] = " ".join(f"{k}:{v}" for k, v in sorted(cycles.items())) if len(cycles) > 1 else ""
                records[name].append(Record(
                    dataset=args.dataset, prompt_id=prompt.id, turn=0, context=args.context, repeat=rounds,
                    mode=name, block_size=size, prompt_tokens=len(ids), generated_tokens=len(outputs[name]),
                    ttft_s=0.0, decode_s=seconds, decode_tps=(len(outputs[name]) - 1) / seconds,
                    peak_memory_gb=0.0, finish_reason=None, acceptance_lengths=[], draft_s=0.0, verify_s=0.0,
                    match=None, first_mismatch=None, block_size_histogram=dict(cycles)))
            speeds = "  ".join(f"{n} {records[n][-1].decode_tps:.2f}" + (f" ({mixed[n]})" if mixed[n] else "")
                               for n in names)
            print(f"{prompt.id} round {rounds + 1}/{args.rounds}: {speeds} tok/s", flush=True)
            for name in names[1:]:
                if (at := first_mismatch(outputs[TARGET], outputs[name])) is not None:
                    failures += 1
                    print(f"{prompt.id} round {rounds + 1}: {name} differs from the target alone at token {at}")
    base = records[TARGET]
    print(f"{'mode':<16}{'tok/s':>8}{'/ target':>10}  90% interval  cycles per block size")
    for name in names:
        line = f"{name:<16}{decode_tps(records[name]):>8.2f}"
        if name != TARGET:
            r = paired_ratio(records[name], base)
            line += f"{r['ratio']:>10.3f}  {r['low']:.3f}-{r['high']:.3f}"
            line += "  " + " ".join(f"{k}:{v}" for k, v in sizes_used[name].most_common())
        print(line)
    if AUTO in sizes:
        auto = records[names[sizes.index(AUTO) + 1]]
        for name in names[1:]:
            if name != auto[0].mode:
                r = paired_ratio(auto, records[name])
                print(f"{auto[0].mode} / {name}: {r['ratio']:.3f} ({r['low']:.3f}-{r['high']:.3f})")
    if failures:
        sys.exit(f"{failures} runs differ from the target alone")


if __name__ == "__main__":
    main()
