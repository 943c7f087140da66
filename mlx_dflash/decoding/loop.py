"""The decode loop: `stream_session` feeds new input to a session, then yields one event per cycle.

Each cycle's size and source come from the block-size policy it is given; the loop stops
at a stop token or the token budget, keeps the detokenizer and the stats, and leaves the
session consistent at every `yield`, so a consumer may stop there and keep the session
(`stream_guard.py` says what to do when it ends otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..platform.runtime import generation_stream
from .block_size import BlockSizePolicy, FixedBlockSize
from .session import DecodingSession
from .stats import GenerationStats


@dataclass
class GenerationEvent:
    """One verify cycle's output (the first event carries the prefill's token)."""

    tokens: list[int]  # newly emitted token ids (a stop token is not emitted)
    num_draft_accepted: int  # how many of `tokens` the drafter proposed
    text: str  # the text segment these tokens completed
    stats: GenerationStats
    finish_reason: str | None = None  # "stop" | "length" | None while running
    logprobs: Any = None  # (len(tokens), V) the target's log-probabilities each token was sampled from, lazily
    source: str | None = None  # who proposed the accepted tokens: "dflash", "lookup" (None: none were)

    @property
    def bonus_token(self) -> int | None:
        """The target's own token of this cycle (absent when the cycle was cut short)."""
        return self.tokens[-1] if len(self.tokens) > self.num_draft_accepted else None


def stream_session(
    session: DecodingSession,
    new_tokens: Sequence[int],
    sampler: Any,
    *,
    max_tokens: int,
    stop: set[int],
    detokenizer: Any,
    profile: bool = False,
    policy: BlockSizePolicy | None = None,
    block_size: int = 1,
    constraint: Any = None,
) -> Iterator[GenerationEvent]:
    """Feed `new_tokens` to an existing session, then decode one event per verify cycle.

    Between events (at every `yield`) the session is consistent: every emitted token
    is committed, so a caller may stop iterating there and keep using the session
    (a multi-turn chat does). A stop token ends generation and stays committed.
    `policy` picks each cycle's block size (default: always `block_size`).
    `constraint` (a fresh `constraint.TokenConstraint`) restricts this generation to its grammar:
    every token is the constrained target's, drafted or not.
    """
    policy = policy or FixedBlockSize(block_size)
    stats = GenerationStats(prompt_tokens=len(new_tokens))
    detokenizer.reset()
    if max_tokens == 0:
        return
    mx.reset_peak_memory()
    clock = Clock()
    session.constraint = constraint  # for this generation only (a cached session outlives it)
    try:
        with mx.stream(generation_stream):  # mlx-lm's generation stream (`mlx_dflash.platform.runtime`)
            produced, accepted, source = [session.extend(list(new_tokens), sampler)], 0, None  # the prefill commits one
        rows = session.prefill_logprobs
        stats.prefill_time = clock.lap()
        policy.begin((len(new_tokens), stats.prefill_time))
        while True:
            finish = None
            if produced[-1] in stop:
                finish = "stop"
            elif stats.num_tokens + len(produced) >= max_tokens:
                finish = "length"
            emitted = produced[:-1] if finish == "stop" else produced
            for token in emitted:
                detokenizer.add_token(token)
            if finish:
                detokenizer.finalize()
                with mx.stream(generation_stream):
                    session.settle()  # a step launched ahead for a cycle that will not come
            stats.num_tokens += len(emitted)
            stats.decode_time += clock.lap()
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            yield GenerationEvent(emitted, min(accepted, len(emitted)), detokenizer.last_segment, stats, finish,
                                  rows[: len(emitted)], source if accepted else None)
            if finish:
                return
            # Never verify more positions than the remaining budget can use.
            with mx.stream(generation_stream):
                size, verified, kept = session.cycle(sampler, policy, max_tokens - stats.num_tokens, stop,
                                                     stats.timings if profile else None)
            produced, accepted, rows = verified.tokens[:kept], verified.num_accepted, verified.logprobs[:kept]
            source = verified.source
            stats.add_cycle(size, len(verified.tokens), session.proposer is not None, policy.prediction, source,
                            verified.tree_size or 0)
    finally:
        session.constraint = None
        with mx.stream(generation_stream):
            session.settle()  # the consumer stopped iterating


class Clock:
    """Wall-clock phases of a generation (prefill, decode)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
