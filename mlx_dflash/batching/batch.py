"""Several decoding sessions advancing together: one draft forward and one verify forward per cycle.

A `SessionBatch` takes over the caches of the `DecodingSession`s it is given (the target's
into `RaggedKVCache`s, the drafter's into a `RaggedDraftCache`) and runs their cycles as
one: the drafter drafts a block for every row in one forward, the target verifies every
row's block in one forward, and each row keeps its own accepted prefix (per-row commit and
rollback). A member's own `cycle` then returns its part (`take`), so `stream_session`
drives a batched session exactly as a lone one; `remove` hands the caches back.

Every row verifies the same number of positions (one shared width): a forward over B rows
of W positions costs what its B x W positions cost, so a row given fewer drafted tokens
saves nothing, while more can only be accepted. The width is chosen by a block-size policy
of its own, told each cycle's cost per row and every row's acceptance: it maximises the
batch's committed tokens per second. Each row's tokens are its target's own: greedy rows
take the argmax of their row, sampled rows their sampler's draw, and drafted tokens are
accepted while they equal it.

What cannot be batched (`refusal`): caches that are not plain K/V (sliding-window, recurrent,
quantized), RoPE that needs one offset, draft windows, proposers other than a v1 DFlash
drafter, several ranks. Batched drafting and injection take one position per row, so they
run the pure-MLX reference of the Metal kernels; a float16 drafter's overflow check
(`DFlashProposer.checked`) runs only for a session decoding alone (an overflowed draft is
rejected, never emitted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..decoding.block_size import BlockSizePolicy
from ..decoding.sampling import TargetSampler
from ..decoding.session import DecodingSession
from ..decoding.step import Verified
from ..errors import DFlashError
from ..platform.runtime import generation_stream
from ..proposers.base import DFLASH
from ..proposers.dflash import DFlashProposer
from ..proposers.dflash2 import DFlash2Proposer
from ..targets.model import TargetModel
from .draft_cache import RaggedDraftCache
from .target_cache import RaggedKVCache, unbatch_row


def refusal(session: DecodingSession) -> str | None:
    """Why `session` cannot join a batch (None: it can)."""
    target = session.target
    if target.world is not None:
        return "the target is split over several ranks"
    for c in session.cache:
        if type(c) is not KVCache:
            kind = type(c).__name__
            what = {"RotatingKVCache": "sliding-window attention layers", "QuantizedKVCache": "a quantized K/V cache",
                    "ArraysCache": "recurrent layers", "MambaCache": "recurrent layers"}.get(kind, f"{kind} layers")
            return f"the target has {what}, which a batch cannot roll back per row"
    if any(type(m).__name__ == "DynamicNTKScalingRoPE" for _, m in target.model.named_modules()):
        return "the target's dynamic RoPE takes one offset for the whole batch"
    proposer = session.proposer
    if proposer is not None:
        if not isinstance(proposer, DFlashProposer) or isinstance(proposer, DFlash2Proposer):
            return f"the {type(proposer).__name__} proposer drafts one sequence at a time"
        cache = proposer.cache
        if cache.window is not None or any(w is not None for w in cache.layer_windows):
            return "the drafter keeps a sliding window of context"
    return None


@dataclass(frozen=True)
class BatchFootprint:
    """What a batch's caches take, for admission to keep to a memory budget.

    Per position of one row: `token_bytes` in every layer of the target and the drafter,
    `layer_bytes` in the largest single layer (a join, a leave or a growth copies one layer
    at a time while the others stay: that copy is in flight beside the whole batch). Every
    row is as long as the longest, rounded up to the caches' growth step.
    """

    token_bytes: int
    layer_bytes: int
    max_block_size: int = 1

    def slots(self, end: int) -> int:
        """Buffer length per row when the longest row reaches position `end`: a verify writes a
        block past the context, and the drafter keeps room for a block past that."""
        return RaggedKVCache.capacity_for(end + 2 * self.max_block_size)

    def peak(self, rows: int, end: int) -> int:
        """The most bytes the caches of `rows` rows take while none passes position `end`: the
        rows, and while a layer is copied, that layer's new buffers and the joining row's two
        copies of it (as read off its cache, then padded to the batch's length)."""
        return self.slots(end) * (rows * (self.token_bytes + self.layer_bytes) + 2 * self.layer_bytes)


def batch_footprint(target: TargetModel, drafter: Any = None, max_block_size: int = 1) -> BatchFootprint:
    """The footprint of batching `target` (and `drafter`'s context cache); all zero for a config
    this estimate does not read (then only `max_batch` bounds the batch)."""
    total = largest = 0
    for args, dtype in ((target.args, target.dtype), (getattr(drafter, "args", None), None)):
        if args is None:
            continue
        try:
            heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
            head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
            layers = args.num_hidden_layers
        except AttributeError:
            return BatchFootprint(0, 0, max_block_size)
        layer = 2 * heads * head_dim * (dtype or drafter.norm.weight.dtype).size
        total, largest = total + layers * layer, max(largest, layer)
    return BatchFootprint(total, largest, max_block_size)


@dataclass
class _Row:
    session: DecodingSession
    sampler: Any
    stop: set[int]
    limit: int  # the session's token count at which its budget is spent


@dataclass
class BatchedCycle:
    """One row's part of a batched cycle, for its session's `cycle` to return."""

    size: int
    verified: Verified
    kept: int
    budget: int


class SessionBatch:
    def __init__(self, target: TargetModel, policy: BlockSizePolicy):
        self.target = target
        self.policy = policy  # the shared width's
        self.rows: list[_Row] = []
        self.cache: list[RaggedKVCache] = []
        self.draft: RaggedDraftCache | None = None
        self.proposer: DFlashProposer | None = None
        self._done: dict[int, BatchedCycle] = {}  # id(session) -> its part of the last cycle
        self.widths: dict[int, int] = {}  # cycles per width (for logs and benchmarks)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, session: DecodingSession) -> bool:
        return session.batch is self

    def add(self, session: DecodingSession, sampler: Any, stop: set[int], budget: int) -> None:
        """Take `session` in (between its cycles): it decodes at most `budget` more tokens."""
        reason = refusal(session)
        if reason is not None:
            raise DFlashError(f"this session cannot be batched: {reason}")
        if self.rows and (session.proposer is None) != (self.proposer is None):
            raise DFlashError("a batch decodes with one drafter for every row, or with none")
        with mx.stream(generation_stream):
            session.settle()
            if session.proposer is not None:
                session.inject_pending()
                if session.proposer.cache.offset != session.position:
                    raise DFlashError("the draft cache does not end at the pending token")
            # Layer by layer, each evaluated (`extend` does): one layer's copy in flight at a time.
            rows = []
            for layer, c in enumerate(session.cache):
                row = RaggedKVCache.from_caches([c])
                if self.rows:
                    self.cache[layer].extend(row)
                else:
                    mx.eval([a for a in (row.keys, row.values) if a is not None])
                    rows.append(row)
            if not self.rows:
                self.cache = rows
                self.proposer = session.proposer
            if session.proposer is not None:
                joined = RaggedDraftCache.from_caches([session.proposer.cache])
                if self.draft is None:
                    self.draft = joined
                else:
                    self.draft.extend(joined)
        self.rows.append(_Row(session, sampler, stop, len(session.tokens) + budget))
        session.batch, session.cache = self, None

    def remove(self, session: DecodingSession) -> None:
        """Hand `session` its caches back (it goes on alone, or is stored); the others are untouched."""
        i = next(i for i, row in enumerate(self.rows) if row.session is session)
        keep = [j for j in range(len(self.rows)) if j != i]
        with mx.stream(generation_stream):
            session.cache = unbatch_row(self.cache, i)
            if self.draft is not None:
                session.proposer.cache = self.draft.row(i)
            # The row's copy first: a lazy copy would keep every old buffer alive through the shrink.
            mx.eval([c.state for c in session.cache], session.proposer.state_arrays() if self.draft else [])
            for c in self.cache:
                c.filter(keep)
            if self.draft is not None:
                self.draft.filter(keep)
        del self.rows[i]
        self._done.pop(id(session), None)
        session.batch = None
        if not self.rows:
            self.cache, self.draft, self.proposer = [], None, None

    def take(self, session: DecodingSession, budget: int) -> tuple[int, Verified, int]:
        """`session`'s part of the last cycle: (block size, what was verified, tokens kept)."""
        done = self._done.pop(id(session), None)
        if done is None:
            raise DFlashError("a batched session's cycle runs in its batch: call SessionBatch.step first")
        if done.budget != budget:
            raise DFlashError(f"the batch decoded this row with a budget of {done.budget}, its stream has {budget}")
        return done.size, done.verified, done.kept

    def _width(self, budgets: list[int], positions: list[int]) -> int:
        if self.proposer is None:
            return 1
        return max(1, min(self.policy.choose(max(budgets), max(positions)), max(budgets)))

    def step(self) -> None:
        """One cycle for every row; each row's outcome waits for its session's `cycle`."""
        if not self.rows:
            return
        started = time.perf_counter()
        sessions = [row.session for row in self.rows]
        budgets = [row.limit - len(s.tokens) for row, s in zip(self.rows, sessions, strict=True)]
        positions = [s.position for s in sessions]
        width = self._width(budgets, positions)
        with mx.stream(generation_stream):
            self._reserve(max(positions) + width)
            offsets = mx.array(positions, dtype=mx.int32)
            inputs = mx.array([s.tokens[-1] for s in sessions], dtype=mx.uint32)[:, None]
            if width > 1:
                inputs = mx.concatenate([inputs, self._draft(inputs, offsets, width)], axis=1)
            capture = self.proposer.target_layer_ids if self.proposer is not None else ()
            hidden, features = self.target.forward(inputs, self.cache, capture)
            logits = self.target.logits(hidden)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (B, W, V)
            chosen = self._sample(logprobs)
            # Accept drafted tokens while they equal the token the row's target chose (or sampled)
            # there; the target's token at the first mismatch is emitted instead (lossless).
            accepted = mx.cumprod(inputs[:, 1:] == chosen[:, :-1], axis=1).sum(axis=1)
            mx.eval(chosen, accepted)
            chosen, accepted = chosen.tolist(), accepted.tolist()  # the cycle's one host read: a decision
            kept = []
            for row, tokens, a, budget in zip(self.rows, chosen, accepted, budgets, strict=True):
                produced = tokens[: a + 1]
                kept.append(next((i + 1 for i, t in enumerate(produced) if t in row.stop or i + 1 >= budget),
                                 len(produced)))
            for c in self.cache:
                c.advance(kept)
            if self.draft is not None:
                keys, values = self.proposer.injector.rows(features, offsets, self.draft.dtype)
                self.draft.write(list(keys), list(values), kept)
                mx.async_eval(self.draft.state_arrays())  # no chain of writes waits for the next draft
        for i, (s, tokens, a, k) in enumerate(zip(sessions, chosen, accepted, kept, strict=True)):
            produced = tokens[: a + 1]
            verified = Verified(produced, a, None, inputs[i], logprobs=logprobs[i],
                                source=DFLASH if width > 1 else None)
            s.tokens.extend(produced[:k])
            self._done[id(s)] = BatchedCycle(width, verified, k, budgets[i])
        self.widths[width] = self.widths.get(width, 0) + 1
        self._record(width, accepted, time.perf_counter() - started)

    def _reserve(self, end: int) -> None:
        """Room for this cycle's writes, grown before the forward one layer at a time (the forward
        would copy every layer at once): growth happens once every few hundred positions."""
        for c in self.cache:
            c.reserve(end)
        if self.draft is not None:
            self.draft.reserve(end + self.draft.max_block_size)

    def _draft(self, pending: mx.array, offsets: mx.array, width: int) -> mx.array:
        """Every row's draft (B, width - 1) from one drafter forward."""
        drafter: nn.Module = self.proposer.drafter
        masks = mx.full((pending.shape[0], width - 1), drafter.mask_token_id, dtype=mx.uint32)
        block = mx.concatenate([pending, masks], axis=1)
        hidden = drafter(self.target.embed(block), self.draft, offsets)
        return mx.argmax(self.target.logits(hidden[:, 1:]), axis=-1).astype(mx.uint32)

    def _sample(self, logprobs: mx.array) -> mx.array:
        """Each row's tokens (B, W) from its own sampler; greedy rows share one argmax."""
        greedy = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        if not any(isinstance(row.sampler, TargetSampler) for row in self.rows):
            return greedy
        return mx.stack([row.sampler(logprobs[i]).astype(mx.uint32) if isinstance(row.sampler, TargetSampler)
                         else greedy[i] for i, row in enumerate(self.rows)])

    def _record(self, width: int, accepted: list[int], seconds: float) -> None:
        """The width policy learns each row's acceptance and the cycle's cost per row."""
        acceptance = getattr(self.policy, "acceptance", None)
        if width > 1 and acceptance is not None:
            for a in accepted[1:]:
                acceptance.observe(width - 1, a)
        self.policy.record(width, accepted[0], seconds / len(accepted))
