"""The Python API: `stream_generate` (one event per verify cycle) and `generate`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .constraint import TokenConstraint
from .drafter import DEFAULT_BLOCK_SIZE, DFlashDraftModel
from .errors import DFlashError
from .lookup import PromptLookup
from .policy import AUTO, LOOKUP_BLOCK, BlockSizePolicy, FixedBlockSize, make_policy, reproducible
from .proposer2 import dflash_proposer
from .rank_follower import follows_rank_zero, rank_follower
from .runtime import generation_stream, wired_limit
from .sampling import make_sampler
from .session import Clock, DecodingSession
from .speculative import DFlashProposer, Proposer
from .target import TargetModel, as_target


def mean_acceptance(lengths: Sequence[int]) -> float:
    """tau: mean tokens committed per verify cycle."""
    return sum(lengths) / max(len(lengths), 1)


def acceptance_histogram(lengths: Sequence[int]) -> list[int]:
    """histogram[n] = cycles that committed n tokens."""
    counts = [0] * (max(lengths, default=0) + 1)
    for n in lengths:
        counts[n] += 1
    return counts


class CycleSummary:
    """What cycles add up to, for anything holding `acceptance_lengths`, `block_sizes`,
    `predicted_tokens` and `predicted_seconds` (one generation's stats, a chat's totals)."""

    acceptance_lengths: list[int]
    block_sizes: list[int]
    predicted_tokens: float
    predicted_seconds: float

    @property
    def tau(self) -> float:
        """Mean tokens per target forward pass in the decode phase."""
        return mean_acceptance(self.acceptance_lengths)

    @property
    def histogram(self) -> list[int]:
        return acceptance_histogram(self.acceptance_lengths)

    @property
    def block_size_histogram(self) -> dict[int, int]:
        """Cycles per chosen block size."""
        return dict(sorted(Counter(self.block_sizes).items()))

    @property
    def predicted_tps(self) -> float | None:
        """Tokens per second the block-size policy's cost model expected (None: no model)."""
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds > 0 else None


@dataclass
class GenerationStats(CycleSummary):
    prompt_tokens: int = 0
    num_tokens: int = 0  # generated tokens (stop token excluded)
    acceptance_lengths: list[int] = field(default_factory=list)  # a + 1 per cycle
    prefill_time: float = 0.0
    decode_time: float = 0.0
    peak_memory_gb: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # draft/verify seconds (profile)
    plain_cycles: int = 0  # cycles run as plain target steps although a drafter was there
    block_sizes: list[int] = field(default_factory=list)  # each cycle's block size (1: a plain step)
    predicted_tokens: float = 0.0  # `--block-size auto`: its expectations, summed over the cycles
    predicted_seconds: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # proposed tokens accepted, per source
    proposed_by_source: dict[str, int] = field(default_factory=dict)  # tokens proposed, per source
    cycles_by_source: dict[str, int] = field(default_factory=dict)  # verify cycles of each source

    def add_cycle(self, size: int, produced: int, drafter: bool, prediction: tuple[float, float] | None,
                  source: str | None = None) -> None:
        self.acceptance_lengths.append(produced)
        self.block_sizes.append(size)
        self.plain_cycles += size == 1 and drafter
        if source is not None:
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + produced - 1
            self.proposed_by_source[source] = self.proposed_by_source.get(source, 0) + size - 1
            self.cycles_by_source[source] = self.cycles_by_source.get(source, 0) + 1
        if prediction is not None:
            self.predicted_tokens += prediction[0]
            self.predicted_seconds += prediction[1]


    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)


    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens after the first (which comes from the prefill) per decode second."""
        decoded = max(self.num_tokens - 1, 0)
        return decoded / self.decode_time if self.decode_time else 0.0


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


def trained_block_size(draft_model: DFlashDraftModel | Proposer | None) -> int | None:
    """The block size the drafter was trained for (None: a proposer that declares none)."""
    if isinstance(draft_model, DFlashProposer):
        return draft_model.drafter.block_size
    return getattr(draft_model, "block_size", None)


def check_block_size(block_size: int | None, draft_model: DFlashDraftModel | Proposer | None, *,
                     lookup: bool = False) -> int:
    """The block size to decode with: by default the drafter's; larger than its trained block is refused.

    Without a drafter it is 1 (plain decoding), whatever was asked, or with `lookup` (prompt
    lookup alone) the size asked, by default `LOOKUP_BLOCK`.
    """
    if block_size is not None and block_size < 1:
        raise DFlashError(f"block size must be >= 1, got {block_size}")
    if draft_model is None:
        return (block_size or LOOKUP_BLOCK) if lookup else 1
    trained = trained_block_size(draft_model)
    if block_size is None:
        return trained or DEFAULT_BLOCK_SIZE
    if trained is not None and block_size > trained:
        raise DFlashError(f"block size {block_size} exceeds the drafter's trained block size {trained}")
    return block_size


def make_proposer(
    target: TargetModel,
    draft_model: DFlashDraftModel | Proposer | None,
    block_size: int,
    draft_window: int | None = None,
) -> Proposer | None:
    """The proposer the decode loop drafts with: a drafter's, a caller's own, or None.

    Distributed, ranks other than 0 verify rank 0's blocks, so a drafter there is replaced by a
    follower that drafts nothing (`rank_follower`); a caller's own proposer runs on every rank.
    """
    if isinstance(draft_model, (DFlashDraftModel, DFlashProposer)) and follows_rank_zero(target):
        return rank_follower(draft_model, max_block_size=block_size, window=draft_window)
    if draft_model is None or isinstance(draft_model, DFlashProposer):
        return draft_model
    if isinstance(draft_model, DFlashDraftModel):
        return dflash_proposer(draft_model, target, max_block_size=block_size, window=draft_window)
    return draft_model  # a custom Proposer (tests, research)


def stream_generate(
    model: nn.Module | TargetModel,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int],
    *,
    draft_model: DFlashDraftModel | Proposer | None = None,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    block_size: int | str | None = None,
    draft_window: int | None = None,
    stop_tokens: Sequence[int] = (),
    profile: bool = False,
    calibration: Any = None,
    policy: BlockSizePolicy | None = None,
    prompt_lookup: bool = True,
    json_schema: dict | bool | None = None,
) -> Iterator[GenerationEvent]:
    """Generate with DFlash and prompt lookup (the target alone with neither).

    Greedy output is token-identical to the target decoding alone; with temp > 0
    every token is an exact sample of the target's (top-p/top-k/min-p filtered)
    distribution. `profile` syncs after drafting to split draft/verify time.
    `block_size`: "auto" (the default, None) chooses each cycle's size for the most
    tokens per second (`mlx_dflash.policy`), seeded by a `calibration` when given
    (with a `seed` and temp > 0 it is the drafter's block, for reproducible samples);
    an int fixes it. `policy` overrides both (research, tests). Output never depends on it.
    `prompt_lookup`: also verify proposals read off the prompt and the reply so far
    (`mlx_dflash.lookup`) when `auto` expects them to pay; without a drafter they are the
    only proposals (a fixed `block_size` then caps them).
    `json_schema`: constrain the reply to JSON following this schema (True: any JSON object) by
    masking the target's distribution at every verified position (needs llguidance: the `serve`
    extra); the reply is exactly the constrained target's, and drafted tokens outside it are rejected.
    """
    target = as_target(model)
    constraint = None
    if json_schema is not None and json_schema is not False:
        if target.world is not None:
            raise DFlashError("json_schema is not supported across ranks yet")
        schema = None if json_schema is True else json_schema
        constraint = TokenConstraint.for_json(tokenizer, schema, target.vocab_size)
    # Distributed, every rank prefills rank 0's ids (tokenizers of other versions may split text otherwise).
    ids = target.agree_tokens(tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
    if not ids:
        raise DFlashError("the prompt is empty: give at least one token")
    if max_tokens < 0:
        raise DFlashError(f"max_tokens must be >= 0, got {max_tokens}")
    auto = block_size in (None, AUTO)
    if draft_model is None and prompt_lookup:
        block_size = LOOKUP_BLOCK if auto else check_block_size(block_size, None, lookup=True)
    else:
        block_size = check_block_size(None if auto else block_size, draft_model)
    if draft_window is not None and draft_window < 1:
        raise DFlashError(f"draft window must be >= 1 token, got {draft_window}")
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)
    stop = set(tokenizer.eos_token_ids) | set(stop_tokens)
    proposer = make_proposer(target, draft_model, block_size, draft_window)
    session = DecodingSession(target, proposer, lookup=PromptLookup() if prompt_lookup else None)
    policy = policy or reproducible(make_policy(AUTO if auto else block_size, block_size, calibration,
                                                drafter=proposer is not None, lookup=prompt_lookup),
                                    block_size, seed, temp)
    with wired_limit([target.model, draft_model]):
        yield from stream_session(session, ids, sampler, max_tokens=max_tokens, stop=stop,
                                  detokenizer=tokenizer.detokenizer, profile=profile, policy=policy,
                                  constraint=constraint)


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
        with mx.stream(generation_stream):  # mlx-lm's generation stream (`mlx_dflash.runtime`)
            produced, accepted, source = [session.extend(list(new_tokens), sampler)], 0, None  # the prefill commits one
        rows = session.prefill_logprobs
        stats.prefill_time = clock.lap()
        policy.begin()
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
            stats.add_cycle(size, len(verified.tokens), session.proposer is not None, policy.prediction, source)
    finally:
        session.constraint = None
        with mx.stream(generation_stream):
            session.settle()  # the consumer stopped iterating


def generate(
    model: nn.Module | TargetModel,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int],
    **kwargs,
) -> str:
    """Generate a completion and return its text (see `stream_generate` for options)."""
    return "".join(event.text for event in stream_generate(model, tokenizer, prompt, **kwargs))
