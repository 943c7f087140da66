"""Decoding state shared by every mode: target cache, draft context, committed tokens.

Invariant between calls: `tokens` holds every committed token; the target cache
and the draft context hold all of them but the last (the pending token, which
starts the next block). `extend` appends new input (a prompt, a chat turn) and
samples one token; `step` runs one verify cycle; `keep` commits a prefix of
what a cycle produced and rolls everything else back.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from .speculative import Proposer, Verified, speculative_step
from .target import TargetModel

PREFILL_CHUNK = 2048


class DecodingSession:
    def __init__(self, target: TargetModel, proposer: Proposer | None = None):
        self.target = target
        self.proposer = proposer
        self.cache = target.make_cache()
        self.tokens: list[int] = []
        self._inputs = 0  # positions of the last step's verify inputs in the target cache

    @property
    def position(self) -> int:
        """Absolute position of the pending token."""
        return len(self.tokens) - 1

    @property
    def capture(self) -> list[int]:
        return self.proposer.target_layer_ids if self.proposer is not None else []

    def _feed(self, inputs: list[int], start: int) -> mx.array:
        """Run `inputs` (absolute positions from `start`) through the target in chunks,
        committing their features to the drafter; returns the last position's logits."""
        logits = None
        for lo in range(0, len(inputs), PREFILL_CHUNK):
            chunk = mx.array(inputs[lo : lo + PREFILL_CHUNK], dtype=mx.uint32)[None]
            hidden, features = self.target.forward(chunk, self.cache, self.capture)
            if self.proposer is not None:
                self.proposer.commit(features, start + lo)
            logits = self.target.logits(hidden[:, -1:])[0]
            mx.eval(logits, self.proposer.state_arrays() if self.proposer is not None else [])
        return logits

    def extend(self, new_tokens: list[int], sampler: Any) -> int:
        """Feed new input after the committed tokens and sample the next token.

        Only the pending token and `new_tokens` are computed: earlier turns stay cached.
        Returns the sampled token, which is committed (it becomes the pending token).
        """
        if not new_tokens:
            raise ValueError("extend() needs at least one new token")
        logits = self._feed(self.tokens[-1:] + list(new_tokens), max(self.position, 0))
        token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item()
        self.tokens.extend(list(new_tokens) + [token])
        return token

    def step(self, sampler: Any, block_size: int, timings: dict[str, float] | None = None) -> Verified:
        """One verify cycle from the pending token; follow it with `keep`."""
        last = mx.array(self.tokens[-1:], dtype=mx.uint32)
        verified = speculative_step(
            self.target, self.cache, self.proposer, sampler, last, self.position, block_size,
            timings=timings,
        )
        self._inputs = block_size if self.proposer is not None else 1
        return verified

    def keep(self, verified: Verified, count: int) -> None:
        """Commit the first `count` produced tokens; roll back the rest of the cycle."""
        if not 1 <= count <= len(verified.tokens):
            raise ValueError(f"can keep 1..{len(verified.tokens)} tokens, not {count}")
        # The cache holds the pending token plus the verify inputs after it; keep the
        # pending token and the first count - 1 new tokens (the last is the new pending).
        self.target.rollback(self.cache, self._inputs - count, verified.checkpoint,
                             verified.inputs[:count])
        if self.proposer is not None and verified.features is not None:
            self.proposer.commit(verified.features[:, :count], self.position)
        self.tokens.extend(verified.tokens[:count])
        self._inputs = 0

    def truncate(self, length: int) -> None:
        """Roll the whole state back to the first `length` committed tokens (length >= 1)."""
        drop = len(self.tokens) - length
        if drop <= 0:
            return
        try:
            if self.target.checkpoint(self.cache) is not None:
                raise ValueError("recurrent target state cannot be rewound")
            if self.proposer is not None:
                self.proposer.trim(drop)  # first: a draft window may refuse
        except ValueError:
            # Without a way back, recompute the kept prefix from scratch.
            self.cache = self.target.make_cache()
            if self.proposer is not None:
                self.proposer.trim(len(self.tokens) - 1)
            self._feed(self.tokens[: length - 1], 0)
        else:
            self.target.rollback(self.cache, drop)
        del self.tokens[length:]


class Clock:
    """Wall-clock phases of a generation (prefill, decode)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
