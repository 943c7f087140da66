"""Decoding state shared by every mode: target cache, draft context, committed tokens.

Invariant between calls: `tokens` holds every committed token; the target cache
holds all of them but the last (the pending token, which starts the next block),
and so do the draft context and the queued features together. `extend` appends new input (a prompt, a chat turn) and
samples one token; `step` runs one verify cycle; `keep` commits a prefix of
what a cycle produced and rolls everything else back.

Committed target features reach the drafter lazily: `keep` only queues them, and
they are injected in one batch by the next drafting cycle. So plain steps (block 1)
never pay for the drafter, and no unevaluated draft-cache writes pile up between
drafting cycles; `prepare` injects a longer backlog (and evaluates it) before the
cycle starts, so that a timed cycle costs what that cycle does.

A run of plain steps is pipelined as mlx-lm pipelines decoding: when the block-size
policy promises that the next cycle is a plain step too, `cycle` launches it on the lazily
sampled token before reading this one, so building one step's graph overlaps computing
the last, and charges each cycle the work done for it. Until the next `step` takes it,
that step is not part of the state: anything else first drops it (`settle`).

With prompt lookup (`mlx_dflash.proposers.lookup`) a cycle may verify a proposal read off the committed
tokens instead of a draft; the policy chooses the source, and every cycle tells it what
the lookup's proposal would have done (`shadow`). A lookup cycle leaves the drafter's
features queued, as a plain step does.

A target whose caches cannot be rewound (recurrent, rotating) keeps `marks` while it is
fed (`prefix_marks`): at the positions its owner asks for (`mark_at`), the state of those
caches, so that `truncate` can go back to any marked length without recomputing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..proposers.base import DFLASH, LOOKUP, Proposer, scores_blocks
from ..proposers.lookup import PromptLookup
from ..targets.model import Checkpoint, TargetModel
from .block_size import TREE, BlockSizePolicy
from .prefix_marks import PrefixMark, thin
from .step import Launched, Verified, launch_step
from .tree_step import launch_tree, refusal

PREFILL_CHUNK = 2048
LOOKUP_TOKENS = 15  # the most tokens prompt lookup proposes (a block of 16)
MAX_PROPOSAL = 1 << 20  # the drafter can propose as many as the policy asks
MAX_PENDING = 512  # queued feature positions past which plain steps inject them anyway (memory)


class PrefillCancelled(Exception):
    """`extend` stopped between prefill chunks: `cancel_check` said so. The chunks fed so far are
    committed (the next input token is the pending one), so the session stays consistent."""


class DecodingSession:
    def __init__(self, target: TargetModel, proposer: Proposer | None = None, *, defer_injection: bool = True,
                 lookup: PromptLookup | None = None):
        self.target = target
        self.proposer = proposer
        self.lookup = lookup  # prompt lookup's index of `tokens`, or None (off)
        self.cache = target.make_cache()
        self.tokens: list[int] = []
        self._inputs = 0  # positions of the last step's verify inputs in the target cache
        self.defer_injection = defer_injection  # False: inject at every `keep` (the reference)
        self._pending: list[tuple[mx.array, int]] = []  # (features, position) not yet injected
        self._ahead: Launched | None = None  # a plain step launched before its cycle (pipelining)
        self._ahead_seconds = 0.0  # what launching it took (its cycle's work, done in the one before)
        # The last step's work done in the cycle before it, less the next one's done in it: a
        # cycle's timer plus this is what the cycle cost (a launch ahead may block for a while).
        self.moved_seconds = 0.0
        # Unrewindable caches (recurrent, rotating): `truncate` needs a mark to go back without recomputing.
        self.rewindable = target.checkpoint(self.cache) is None
        # Launching ahead needs a cheap way back (a trim) and no other rank to keep in step with.
        self.can_launch_ahead = target.world is None and self.rewindable
        self.prefill_logprobs: mx.array | None = None  # the last `extend`'s sampled row
        # Asked between `extend`'s prefill chunks (a server's request was cancelled): True stops it there.
        self.cancel_check: Callable[[], bool] | None = None
        # The running generation's grammar (`constraint.TokenConstraint`), or None: set by `stream_session`.
        # It masks every row the target samples from and follows the committed tokens.
        self.constraint: Any = None
        # Asked between `extend`'s prefill chunks to let other work run (a server's other requests).
        self.between_chunks: Callable[[], None] | None = None
        self.prefill_chunk = PREFILL_CHUNK  # positions per prefill forward
        # Told (positions fed, positions to feed) after each prefill chunk of `extend`: progress to show.
        self.progress: Callable[[int, int], None] | None = None
        self.marks: list[PrefixMark] = []  # ascending lengths, at most `prefix_marks.MAX_MARKS`
        self.mark_at: set[int] = set()  # cache positions the next feeds mark (only where not rewindable)
        # In a `mlx_dflash.batching.batch.SessionBatch`: the batch holds this session's caches and runs its cycles
        # with the other members'; `cycle` returns this session's part of the last one.
        self.batch: Any = None

    @property
    def position(self) -> int:
        """Absolute position of the pending token."""
        return len(self.tokens) - 1

    @property
    def capture(self) -> list[int]:
        return self.proposer.target_layer_ids if self.proposer is not None else []

    @property
    def launched_ahead(self) -> bool:
        """A plain step was launched for a cycle that has not taken it yet."""
        return self._ahead is not None

    @property
    def pending_positions(self) -> int:
        """Committed positions whose features the drafter has not received yet."""
        return sum(features.shape[1] for features, _ in self._pending)

    def inject_pending(self) -> None:
        """Hand every queued feature chunk to the drafter in one batch (lazily)."""
        if not self._pending:
            return
        features = mx.concatenate([f for f, _ in self._pending], axis=1) if len(self._pending) > 1 \
            else self._pending[0][0]
        start = self._pending[0][1]
        self._pending = []
        for lo in range(0, features.shape[1], PREFILL_CHUNK):
            self.proposer.commit(features[:, lo : lo + PREFILL_CHUNK], start + lo)

    def settle(self) -> None:
        """Drop a plain step launched ahead that no cycle took (generation ended, or stopped)."""
        if self._ahead is not None:
            self._ahead = None
            self.target.rollback(self.cache, 1)

    def prepare(self, block_size: int) -> None:
        """Before a cycle: inject a backlog of queued features when this cycle drafts (or when
        it grew long: memory) and evaluate it. `cycle` counts it in the drafting cycle's cost:
        a draft after a run of plain steps pays for the positions they left."""
        if block_size > 1:
            self.settle()
        if len(self._pending) > 1 and (block_size > 1 or self.pending_positions >= MAX_PENDING):
            self.inject_pending()
            mx.eval(self.proposer.state_arrays())

    def _feed(self, inputs: list[int], start: int, cancellable: bool = False) -> mx.array:
        """Run `inputs` (absolute positions from `start`) through the target in chunks,
        committing their features to the drafter; returns the last position's logits.
        Chunks end at the positions of `mark_at`, where a mark is kept.
        `cancellable`: raise `PrefillCancelled(fed)` between chunks when `cancel_check` says so."""
        logits = None
        self.settle()
        if self._pending:
            self.inject_pending()  # in order: queued positions come before these
        if not self.rewindable and start and start in self.mark_at:
            self._mark(start + 1)  # the state before this feed
        for lo, hi in self._chunks(len(inputs), start):
            if lo and self.between_chunks is not None:
                self.between_chunks()
            if lo and cancellable and self.cancel_check is not None and self.cancel_check():
                raise PrefillCancelled(lo)
            chunk = mx.array(inputs[lo:hi], dtype=mx.uint32)[None]
            hidden, features = self.target.forward(chunk, self.cache, self.capture)
            if self.proposer is not None:
                self.proposer.commit(features, start + lo)
            logits = self.target.logits(hidden[:, -1:])[0]
            mx.eval(logits, self.proposer.state_arrays() if self.proposer is not None else [])
            self.target.heartbeat()
            if not self.rewindable and start + hi in self.mark_at:
                self._mark(start + hi + 1)
            if self.progress is not None:
                self.progress(hi, len(inputs))
        return logits

    def _mark(self, length: int) -> None:
        """Keep the unrewindable caches' state: they hold the first `length` tokens but the pending one."""
        if all(m.length != length for m in self.marks):
            self.marks = thin(self.marks + [PrefixMark(length, self.target.checkpoint(self.cache).states)])

    def _chunks(self, count: int, start: int) -> list[tuple[int, int]]:
        """[lo, hi) spans of `count` inputs fed from `start`: `prefill_chunk` long, cut at marks."""
        cuts = set(range(self.prefill_chunk, count, self.prefill_chunk))
        if not self.rewindable:
            cuts |= {p - start for p in self.mark_at if start < p <= count + start}
        edges = [0, *sorted(cuts | {count})]
        return list(zip(edges, edges[1:], strict=False))

    def extend(self, new_tokens: list[int], sampler: Any) -> int:
        """Feed new input after the committed tokens and sample the next token.

        Only the pending token and `new_tokens` are computed: earlier turns stay cached.
        Returns the sampled token, which is committed (it becomes the pending token).
        """
        if not new_tokens:
            raise ValueError("extend() needs at least one new token")
        inputs = self.tokens[-1:] + list(new_tokens)
        try:
            logits = self._feed(inputs, max(self.position, 0), cancellable=True)
        except PrefillCancelled as stopped:
            # inputs[:fed] are in every cache: commit them, and inputs[fed] becomes the pending token.
            self.tokens.extend(inputs[len(self.tokens[-1:]) : stopped.args[0] + 1])
            raise
        self.prefill_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (1, V): the token's row
        if self.constraint is not None:
            self.prefill_logprobs = self.constraint.mask(self.prefill_logprobs, [])
        token = self.target.agree(sampler(self.prefill_logprobs)).item()
        if self.constraint is not None:
            self.constraint.commit([token])
        self.tokens.extend(list(new_tokens) + [token])
        return token

    def cuts_drafts(self) -> bool:
        """This session's drafter scores its whole block and drafts its argmax, so a cycle may verify the
        confident prefix (a drafter that samples its draft from a stated q is verified whole, by rejection)."""
        return scores_blocks(self.proposer) and not hasattr(self.proposer, "propose_sampled")

    def tree_refusal(self) -> str | None:
        """Why this session's cycles cannot verify draft trees now (None: they can; `tree_step`)."""
        return refusal(self.target, self.proposer, constraint=self.constraint)

    def step(self, sampler: Any, block_size: int, timings: dict[str, float] | None = None,
             *, ahead: bool = False, draft: list[int] | None = None,
             tree: tuple[int, str, int] | None = None, cut: Callable[[list[float]], int] | None = None) -> Verified:
        """One verify cycle from the pending token; follow it with `keep`.

        `ahead` (a plain step, when the next cycle is known to be one too): launch the next
        step before reading this one. Output is the same either way; only the timing moves.
        `draft`: verify these block_size - 1 tokens (prompt lookup's) instead of drafting.
        `tree` (budget, shape, belief budget): draft a block of `block_size` and verify a tree of it
        (`tree_step`; only where `tree_refusal()` is None).
        `cut`: verify only the prefix of the drafted block that `cut` keeps, told the drafter's confidence
        in each position (`step.confident_draft`; only where `cuts_drafts()`).
        """
        self.target.heartbeat()
        if draft is not None:
            self.settle()
        elif block_size > 1:
            self.settle()
            if self.proposer is not None:
                self.inject_pending()  # the drafter reads every committed position
        if tree is not None:
            last = mx.array(self.tokens[-1:], dtype=mx.uint32)
            launched_tree = launch_tree(self.target, self.cache, self.proposer, sampler, last, self.position,
                                        block_size, tree[0], tree[1], timings, tree[2])
            verified = launched_tree.finish(self.cache, timings)
            self._inputs = verified.inputs.shape[0]  # the accepted branch, compacted
            if verified.draft_finite is not None:
                self.proposer.checked(verified.draft_finite)
            return verified
        launched, self._ahead = self._ahead, None
        self.moved_seconds = self._ahead_seconds if launched is not None else 0.0
        self._ahead_seconds = 0.0
        if launched is None:
            last = mx.array(self.tokens[-1:], dtype=mx.uint32)
            launched = launch_step(self.target, self.cache, self.proposer, sampler, last, self.position,
                                   block_size, timings=timings, draft=draft, constraint=self.constraint,
                                   cut=cut if draft is None else None)
        # Not ahead when profiling (in order), nor under a grammar: the next step's mask needs this one's token.
        if ahead and block_size == 1 and self.can_launch_ahead and timings is None and self.constraint is None:
            mx.async_eval(launched.target_tokens)
            start = time.perf_counter()
            self._ahead = launch_step(self.target, self.cache, self.proposer, sampler,
                                      launched.target_tokens[:1], self.position + 1, 1, timings=timings)
            mx.async_eval(self._ahead.target_tokens)
            self._ahead_seconds = time.perf_counter() - start
            self.moved_seconds -= self._ahead_seconds
        self._inputs = launched.inputs.shape[0]
        verified = launched.finish(timings)
        if verified.draft_finite is not None:
            self.proposer.checked(verified.draft_finite)
        if self._inputs > 1:
            verified.source = LOOKUP if draft is not None else DFLASH
        return verified

    def cycle(self, sampler: Any, policy: BlockSizePolicy, budget: int, stop: set[int],
              timings: dict[str, float] | None = None) -> tuple[int, Verified, int]:
        """One cycle of the size `policy` chooses, kept up to the first stop token or the
        `budget`, the policy told what it cost: (block size, what was verified, tokens kept).
        A member of a batch returns its part of the batch's last cycle instead (already kept)."""
        if self.batch is not None:
            return self.batch.take(self, budget)
        looked_up = self.lookup.propose(self.tokens, LOOKUP_TOKENS) if self.lookup is not None else []
        offers = {DFLASH: MAX_PROPOSAL} if self.proposer is not None else {}
        if looked_up:
            offers[LOOKUP] = len(looked_up)
        if policy.tree_budgets and self.proposer is not None and self.tree_refusal() is None:
            offers[TREE] = MAX_PROPOSAL
        # Timing-based choices differ between ranks: every rank takes rank 0's.
        size = self.target.agree_int(policy.choose(budget, self.position, offers))
        source = policy.source if size > 1 else DFLASH
        if self.target.world is not None and looked_up:
            source = LOOKUP if self.target.agree_int(source == LOOKUP) else DFLASH
        draft = looked_up[: size - 1] if source == LOOKUP else None
        tree = policy.tree if source == DFLASH and size > 1 and TREE in offers else 0
        drafted = source == DFLASH and size > 2 and not tree and draft is None
        # Timing-based: every rank keeps rank 0's cut.
        cut = (lambda c: self.target.agree_int(policy.cut(c))) if drafted and policy.confident \
            and self.cuts_drafts() else None
        ahead = size == 1 and budget > 1 and policy.promise_plain()
        started = time.perf_counter()  # a drafting cycle's cost includes injecting the plain steps' backlog
        self.prepare(size if draft is None else 1)
        verified = self.step(sampler, size, timings, ahead=ahead, draft=draft, cut=cut,
                             tree=(tree, policy.tree_shape, max(policy.tree_budgets)) if tree else None)
        if cut is not None:
            size = verified.inputs.shape[0]  # the prefix verified
        kept = next((i + 1 for i, t in enumerate(verified.tokens) if t in stop or i + 1 >= budget),
                    len(verified.tokens))
        self.keep(verified, kept)
        seconds = time.perf_counter() - started + self.moved_seconds
        if verified.tree_size is None:
            policy.record(size, verified.num_accepted, seconds)
        else:
            policy.record(size, verified.num_accepted, seconds, verified.spine_accepted, verified.draft_belief)
        if looked_up and draft is None:  # what the lookup's proposal would have had accepted
            seen = min(kept, len(looked_up))
            policy.shadow(LOOKUP, seen, next((i for i in range(seen) if verified.tokens[i] != looked_up[i]), seen))
        return size, verified, kept

    def keep(self, verified: Verified, count: int) -> None:
        """Commit the first `count` produced tokens; roll back the rest of the cycle."""
        if not 1 <= count <= len(verified.tokens):
            raise ValueError(f"can keep 1..{len(verified.tokens)} tokens, not {count}")
        # The cache holds the pending token plus the verify inputs after it; keep the
        # pending token and the first count - 1 new tokens (the last is the new pending).
        self.target.rollback(self.cache, self._inputs - count, verified.checkpoint,
                             verified.inputs[:count])
        if self.proposer is not None and verified.features is not None:
            self._pending.append((verified.features[:, :count], self.position))
            if not self.defer_injection:
                self.inject_pending()
        self.tokens.extend(verified.tokens[:count])
        self._inputs = 0
        if self.constraint is not None:
            self.constraint.commit(verified.tokens[:count])

    def reachable(self, length: int) -> int:
        """The longest length <= `length` that `truncate` goes back to without recomputing (0: none)."""
        if length >= len(self.tokens) or self.rewindable:
            return length
        return max((m.length for m in self.marks if m.length <= length), default=0)

    def truncate(self, length: int) -> None:
        """Roll the whole state back to the first `length` committed tokens (length >= 1).

        Unrewindable caches go back to the mark of that length; without one, the kept
        prefix is recomputed from scratch."""
        drop = len(self.tokens) - length
        if drop <= 0:
            return
        self.settle()
        if self.lookup is not None:
            self.lookup.truncate(self.tokens, length)
        self.inject_pending()  # then the drafter holds every committed position and can trim
        mark = next((m for m in self.marks if m.length == length), None)
        self.marks = [m for m in self.marks if m.length <= length]
        try:
            if not self.rewindable and mark is None:
                raise ValueError("recurrent target state cannot be rewound")
            if self.proposer is not None:
                self.proposer.trim(drop)  # first: a draft window may refuse
        except ValueError:
            # Without a way back, recompute the kept prefix from scratch.
            self.cache = self.target.make_cache()
            self.marks = []
            if self.proposer is not None:
                self.proposer.trim(len(self.tokens) - 1)
            self._feed(self.tokens[: length - 1], 0)
        else:
            self.target.rollback(self.cache, drop, Checkpoint(mark.states) if mark is not None else None)
        del self.tokens[length:]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (what a session can keep of a new prompt)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
