"""Decoding sessions kept across requests, least recently used first out, bounded in bytes.

A request takes the session sharing the longest prefix with its prompt: one its
prompt extends (or goes on from but for the pending token, which no cache holds)
is taken over as it is, in every family (attention, hybrid recurrent, sliding
window); one it diverges from earlier is copied and the copy rolled back, which
only caches that can be trimmed allow. For the others a copy taken right after
each prompt (`snapshot`) keeps that prompt reusable. The drafter's context cache
travels inside the session, so it is reused alike.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..chat import common_prefix
from ..session import DecodingSession
from ..speculative import DFlashProposer
from ..target import copy_cache


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

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self._entries.values())

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
            del self._entries[key]  # taken over as it is: its tokens go on in this prompt
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

    def snapshot(self, session: DecodingSession) -> None:
        """Keep a copy of a session that cannot be rolled back, taken right after its prompt.

        Its caches hold the whole prompt and its pending token is the first one generated, so
        a later prompt that shares this prompt but goes on differently (a regenerated reply, a
        template that re-renders past replies) still reuses all of it.
        """
        if self.max_bytes > 0 and session.target.checkpoint(session.cache) is not None:
            clone = clone_session(session)
            if clone is not None:
                self.store(clone)

    def store(self, session: DecodingSession) -> None:
        if self.max_bytes <= 0 or len(session.tokens) < 2:
            return
        session.settle()  # the pending token must be in no cache (`fetch` may replace it)
        # Kept evaluated: no lazy graph (a copy's) waits in the cache, for whichever thread takes it.
        mx.eval(session_arrays(session))
        self._entries[self._next_key] = (session, session_bytes(session))
        self._next_key += 1
        evicted = False
        while self._entries and self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
            evicted = True
        if evicted:
            mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back to the system

    def clear(self) -> None:
        self._entries.clear()
        mx.clear_cache()


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
