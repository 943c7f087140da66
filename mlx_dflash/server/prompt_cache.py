"""Decoding sessions kept across requests, least recently used first out, bounded in bytes.

A request takes the session sharing the longest prefix with its prompt: one its
prompt extends is taken over as it is (every family: attention, hybrid recurrent,
sliding window); one it diverges from is copied and the copy rolled back, which
only caches that can be trimmed allow (otherwise the request starts cold). The
drafter's context cache travels inside the session, so it is reused alike.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..session import DecodingSession
from ..speculative import DFlashProposer


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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


def _fresh(value: Any) -> Any:
    """New handles for arrays (in-place writes into the original must not reach the copy)."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    return value


def copy_cache(cache: Any) -> Any:
    """A copy of one cache object (target layer cache or draft context cache)."""
    clone = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(clone, name, _fresh(value))
    return clone


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
        """A session whose tokens are a proper prefix of `prompt`, and the prompt positions it holds computed."""
        best_key, best = None, 0
        for key, (session, _) in self._entries.items():
            shared = common_prefix(session.tokens, prompt)
            if shared > best:
                best_key, best = key, shared
        keep = min(best, len(prompt) - 1)  # at least one prompt token is fed, to sample from
        if best_key is None or keep < 1:
            return self.new_session(), 0
        session, _ = self._entries[best_key]
        if keep == len(session.tokens):
            del self._entries[best_key]
        else:
            if session.target.checkpoint(session.cache) is not None:
                return self.new_session(), 0  # a recurrent or rotating cache cannot be rewound
            self._entries.move_to_end(best_key)
            session = clone_session(session)
            if session is None:
                return self.new_session(), 0
            before = session.cache
            session.truncate(keep)
            if session.cache is not before:  # the drafter's window refused: recomputed from scratch
                return session, 0
        return session, len(session.tokens) - 1  # the pending token is fed again

    def store(self, session: DecodingSession) -> None:
        if self.max_bytes <= 0 or len(session.tokens) < 2:
            return
        self._entries[self._next_key] = (session, session_bytes(session))
        self._next_key += 1
        while self._entries and self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def describe(cache: PromptCache) -> dict[str, Any]:
    return {"entries": len(cache), "bytes": cache.nbytes, "max_bytes": cache.max_bytes}
