"""A batch of a strong and a weak sequence against the two served apart: does one shared width cost?

    python benchmarks/bench_batch_width.py [--model M] [--draft D] [--tokens 64] [--strong-q 0.1]

`SessionBatch` verifies every row at one width. A strongly drafted sequence wants wide
blocks, a weakly drafted one plain steps; this measures whether batching them together
(the width chosen by `auto` from both rows' acceptance, or fixed) takes longer than decoding
them one after the other, each with its own `auto` sizes. The weak row is drafted by the
real drafter; the strong row's draft is the target's own greedy continuation with a fraction
`--strong-q` of its tokens corrupted (`bench/proposers.py`), after the real drafter has run
for it too, so both rows pay the same drafting cost. When one sequence finishes, the other
goes on alone, as the server hands a lone row back. Every reply is checked against the
target alone. Figures are printed with the machine's name; nothing here is a test.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx_dflash
import mlx.core as mx

from mlx_dflash.batching.batch import SessionBatch
from mlx_dflash.bench.proposers import CorruptedGreedyProposer
from mlx_dflash.generate import stream_generate
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.auto.policy import AUTO, make_policy
from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
BLOCK = 16


class OracleProposer(DFlashProposer):
    """The real drafter runs (its cost is paid), then the corrupted greedy continuation is proposed."""

    oracle: CorruptedGreedyProposer

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        drafted = super().propose(last_token, position, block_size)
        return self.oracle.propose(last_token, position, block_size) + 0 * drafted


class OracleBatch(SessionBatch):
    """The batch's drafts, with the oracle's tokens in place of the drafter's for oracle rows."""

    def _draft(self, pending: mx.array, offsets: mx.array, width: int) -> mx.array:
        drafted = super()._draft(pending, offsets, width)
        rows = []
        for i, row in enumerate(self.rows):
            proposer = row.session.proposer
            oracle = getattr(proposer, "oracle", None)
            rows.append(drafted[i] if oracle is None else
                        oracle.propose(pending[i], row.session.position, width) + 0 * drafted[i])
        return mx.stack(rows)


def session_for(target: TargetModel, drafter, strong: CorruptedGreedyProposer | None) -> DecodingSession:
    proposer = (OracleProposer if strong is not None else DFlashProposer)(drafter, target, max_block_size=BLOCK)
    if strong is not None:
        proposer.oracle = strong
    return DecodingSession(target, proposer)


def decode(members: list[tuple[DecodingSession, list[int]]], tokens: int, width: str | int | None) -> list[list[int]]:
    """Decode every member to `tokens` tokens: apart (width None: one after the other), or batched at
    `width` ("auto" or an int) while two remain, the last one then alone. Returns each reply."""
    sampler = make_sampler(0.0)
    streams = [stream_session(s, p, sampler, max_tokens=tokens, stop=set(), detokenizer=_NoText(),
                              policy=make_policy(AUTO, BLOCK)) for s, p in members]
    replies: list[list[int]] = [[] for _ in members]
    if width is None:
        for reply, stream in zip(replies, streams, strict=True):
            for event in stream:
                reply.extend(event.tokens)
        return replies
    batch = OracleBatch(members[0][0].target, make_policy(AUTO, BLOCK) if width == AUTO else FixedBlockSize(width))
    done = [False] * len(members)
    for i, stream in enumerate(streams):
        event = next(stream)
        replies[i].extend(event.tokens)
        batch.add(members[i][0], sampler, set(), tokens - event.stats.num_tokens)
    while not all(done):
        if len(batch) == 1:
            batch.remove(batch.rows[0].session)
        if len(batch):
            batch.step()
        for i, stream in enumerate(streams):
            if done[i]:
                continue
            event = next(stream)
            replies[i].extend(event.tokens)
            if event.finish_reason:
                done[i] = True
                if members[i][0].batch is not None:
                    batch.remove(members[i][0])
    return replies


class _NoText:
    def reset(self) -> None: ...
    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    last_segment = ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="DFlash drafter (default: the one `chat` picks for the model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--strong-q", type=float, default=0.1, help="share of the strong row's draft tokens corrupted")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from mlx_dflash.loading.resolve import choose_pair

    pair = choose_pair(args.model, args.draft)
    model, tokenizer = mlx_dflash.load(pair.target)[:2]
    drafter = mlx_dflash.load_drafter(pair.draft)
    target = TargetModel(model)
    questions = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines() if line.strip()]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in questions[:2]]
    reference = [[t for e in stream_generate(model, tokenizer, p, max_tokens=args.tokens, prompt_lookup=False)
                  for t in e.tokens] for p in prompts]
    eos = set(tokenizer.eos_token_ids)
    if any(t in eos for r in reference for t in r):
        sys.exit("a reference reply ends early: pick other prompts or fewer --tokens")
    print(f"machine: {machine()}\ntarget: {pair.target}\ndrafter: {pair.draft}")
    print(f"two sequences of {args.tokens} tokens: strong (oracle, {args.strong_q:.0%} of its draft corrupted) and "
          "weak (the drafter); greedy; best of", args.repeats)
    print(f"{'mode':26} {'wall s':>7} {'tok/s':>7}")
    for mode in (None, AUTO, 1, 4, 8, 16):
        best = None
        for _ in range(args.repeats):
            strong = CorruptedGreedyProposer(prompts[0] + reference[0], target.vocab_size, args.strong_q)
            members = [(session_for(target, drafter, strong), prompts[0]),
                       (session_for(target, drafter, None), prompts[1])]
            start = time.perf_counter()
            replies = decode(members, args.tokens, mode)
            wall = time.perf_counter() - start
            if replies != reference:
                sys.exit(f"mode {mode}: a reply differs from the target alone")
            best = wall if best is None else min(best, wall)
        name = "apart (each auto)" if mode is None else f"batched, width {mode}"
        print(f"{name:26} {best:7.2f} {2 * args.tokens / best:7.1f}", flush=True)


if __name__ == "__main__":
    main()
