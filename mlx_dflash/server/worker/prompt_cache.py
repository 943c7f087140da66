"""Decoding sessions kept across requests, least recently used first out, bounded in bytes.

A request takes the session sharing the longest prefix with its prompt: one its
prompt extends (or goes on from but for the pending token, which no cache holds)
is taken over as it is, in every family (attention, hybrid recurrent, sliding
window); one it diverges from earlier is copied and the copy rolled back, which
only caches that can be trimmed allow. For the others a copy taken two tokens
before the end of each prompt (`prefed`) keeps that prompt reusable: asked again (a
regenerated reply, a retry) or gone on from (a re-rendered reply), it computes only
its last positions. The drafter's context cache travels inside the session, so it
is reused alike. A request that fails does not cost the conversation: a session an
error left mid-cycle is trimmed back to its committed tokens where it can be
(`recover`), and kept.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ...decoding.loop import GenerationEvent
from ...decoding.session import DecodingSession, PrefillCancelled, common_prefix
from ...platform.runtime import generation_stream
from ...proposers.dflash import DFlashProposer
from ...targets.model import copy_cache


def session_arrays(session: DecodingSession) -> list[mx.array]:
    """Every array of the session's caches, the drafter's included."""
    arrays = [a for c in session.cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    if session.proposer is not None:
        arrays += session.proposer.state_arrays()
    return arrays


def session_bytes(session: DecodingSession) -> int:
    total = 0
    for c in session.cache:
        try:
            total += c.nbytes
        except (AttributeError, NotImplementedError):
            total += sum(a.nbytes for _, a in tree_flatten(c.state))
    if session.proposer is not None:
        total += sum(a.nbytes for a in session.proposer.state_arrays())
    if session.lookup is not None:  # Python objects, not arrays: as much again as a small model's K/V
        total += session.lookup.nbytes
    return total


def clone_session(session: DecodingSession) -> DecodingSession | None:
    """An independent copy sharing the models (None when the proposer cannot be copied)."""
    proposer = session.proposer
    if proposer is not None:
        if not isinstance(proposer, DFlashProposer):
            return None
        proposer = copy.copy(proposer)
        proposer.cache = copy_cache(session.proposer.cache)
    clone = copy.copy(session)
    for name, value in vars(clone).items():
        if isinstance(value, list):  # tokens, queued drafter input: own lists of immutable values
            setattr(clone, name, list(value))
    clone.cache = [copy_cache(c) for c in session.cache]
    clone.proposer = proposer
    clone.lookup = session.lookup.copy() if session.lookup is not None else None
    return clone


class PromptCache:
    def __init__(self, max_bytes: int, new_session: Callable[[], DecodingSession]):
        self.max_bytes = max_bytes
        self.new_session = new_session
        self._entries: OrderedDict[int, tuple[DecodingSession, int]] = OrderedDict()
        self._next_key = 0
        # Kept as a running total: other threads (/health) read it while the worker evicts.
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, prompt: list[int]) -> tuple[DecodingSession, int]:
        """A session to feed `prompt[len(session.tokens):]` (at least one token) to, and how many
        prompt positions its caches already hold."""
        best: tuple[int, int] | None = None  # (length to keep, entry key)
        for key, (session, _) in self._entries.items():
            keep = _usable_length(session, prompt)
            if keep is not None and (best is None or keep > best[0]):
                best = (keep, key)
        if best is None:
            return self.new_session(), 0
        keep, key = best
        session, _ = self._entries[key]
        if keep == len(session.tokens):
            self._drop(key)  # taken over as it is: its tokens go on in this prompt
        else:
            self._entries.move_to_end(key)  # kept for its own continuation; a copy is rolled back
            session = clone_session(session)
            if session is None:
                return self.new_session(), 0
            before = session.cache
            session.truncate(keep)
            if session.cache is not before:  # the drafter's window refused: recomputed from scratch
                return session, 0
        # The pending token is in no cache (the session invariant): replacing it costs nothing.
        session.tokens[-1] = prompt[keep - 1]
        return session, keep - 1

    def _keeps_copies(self, session: DecodingSession) -> bool:
        """A session that cannot be rolled back is worth a copy before its prompt's end."""
        return self.max_bytes > 0 and session.target.checkpoint(session.cache) is not None

    def split_prompt(self, session: DecodingSession, new: list[int]) -> tuple[list[int], list[int]]:
        """`new` (the prompt after the session's tokens) as (head, rest): `prefed` takes the head
        in (its last token becomes the pending one) and keeps a copy; the rest, the prompt's last
        token, goes to the decode stream. A session that can be rolled back needs no copy."""
        if len(new) <= 2 or not self._keeps_copies(session):
            return [], new
        return new[:-1], new[-1:]

    def prefed(self, session: DecodingSession, head: list[int],
               stream: Iterator[GenerationEvent]) -> Iterator[GenerationEvent]:
        """`stream` (a decode stream over `session`, not started), after taking `head` in and keeping
        a copy of the session, which then holds all of its prompt but the last two tokens.

        So the same prompt asked again takes the copy over (it extends it) and computes only
        those two positions, whatever recurrent or rotating caches the target has. The head's
        prefill counts in the stream's statistics. A cancelled prefill (`PrefillCancelled`) ends
        the stream: the session holds the prompt fed so far, consistently, so it is kept.
        """
        try:
            started = time.perf_counter()
            if head:
                with mx.stream(generation_stream):
                    session.extend(head[:-1], _first_choice)
                session.tokens[-1] = head[-1]  # the pending token is in no cache: replacing it is free
            if self._keeps_copies(session) and len(session.tokens) >= 2:
                clone = clone_session(session)
                if clone is not None:
                    clone.cancel_check = None
                    self.store(clone)
            early = time.perf_counter() - started
            first = True
            for event in stream:
                if first:
                    event.stats.prompt_tokens += len(head)
                    event.stats.prefill_time += early
                    first = False
                yield event
        except PrefillCancelled:
            return  # the session holds the prompt fed so far, consistently: kept, the request ends cancelled
        finally:
            stream.close()  # its own cleanup (a step launched ahead dropped) before the session is stored

    def store(self, session: DecodingSession) -> None:
        if self.max_bytes <= 0 or len(session.tokens) < 2:
            return
        session.settle()  # the pending token must be in no cache (`fetch` may replace it)
        # Kept evaluated: no lazy graph (a copy's) waits in the cache, for whichever thread takes it.
        mx.eval(session_arrays(session))
        size = session_bytes(session)
        self._entries[self._next_key] = (session, size)
        self.nbytes += size
        self._next_key += 1
        evicted = False
        while self._entries and self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            evicted = True
        if evicted:
            mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back to the system

    def _drop(self, key: int) -> None:
        _, size = self._entries.pop(key)
        self.nbytes -= size

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
        mx.clear_cache()


def _first_choice(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def recover(session: DecodingSession) -> bool:
    """Make a session that an exception left mid-cycle (or mid-prefill) consistent again, if its
    caches can be trimmed: every cache is cut back to the committed tokens, which a cycle or a
    prefill only ever writes past. False: it cannot be (a recurrent or rotating cache, another
    proposer), and must not be reused."""
    committed = len(session.tokens) - 1  # positions the caches hold (the pending token is in none)
    if committed < 1 or session.target.checkpoint(session.cache) is not None:
        return False
    proposer = session.proposer
    if proposer is not None and not isinstance(proposer, DFlashProposer):
        return False
    try:
        session.settle()
        for c in session.cache:
            if c.offset < committed:
                return False
            c.trim(c.offset - committed)
        if proposer is not None:
            extra = proposer.cache.offset + session.pending_positions - committed
            if extra < 0:
                return False
            proposer.trim(extra)
    except Exception:  # a window that cannot give back positions, or state the error broke
        return False
    return True


def _usable_length(session: DecodingSession, prompt: list[int]) -> int | None:
    """How many of the session's tokens a request for `prompt` can keep (None: no use).

    Kept tokens but the last must equal the prompt's (that last one, pending, can be swapped),
    at least one prompt token must remain to be fed, and keeping fewer than the session has
    needs caches that can be trimmed.
    """
    keep = min(common_prefix(session.tokens, prompt) + 1, len(session.tokens), len(prompt) - 1)
    if keep < 2:
        return None
    if keep < len(session.tokens) and session.target.checkpoint(session.cache) is not None:
        return None  # a recurrent or rotating cache cannot be rewound
    return keep


def describe(cache: PromptCache) -> dict[str, Any]:
    return {"entries": len(cache), "bytes": cache.nbytes, "max_bytes": cache.max_bytes}
