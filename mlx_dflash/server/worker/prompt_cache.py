"""Decoding sessions kept across requests, least recently used first out, bounded in bytes.

A request takes the session sharing the longest prefix with its prompt: one its
prompt extends (or goes on from but for the pending token, which no cache holds)
is taken over as it is, in every family (attention, hybrid recurrent, sliding
window); one it diverges from earlier is copied and the copy rolled back: trimmed, where
the caches can be; for recurrent and rotating caches, to the session's latest mark
before the divergence (`decoding.prefix_marks`: kept while prefilling, before each
message opens and every few thousand positions), so a new session or a sub-agent that
shares a long system prompt and its tools reuses them on every family. A mark two tokens
before the end of each prompt keeps that prompt reusable too: asked again (a regenerated
reply, a retry) or gone on from (a re-rendered reply), it computes only its last
positions. The drafter's context cache travels inside the session, so it is reused
alike. A request that fails does not cost the conversation: a session an error left
mid-cycle is trimmed back to its committed tokens, or to its latest mark (`recover`),
and kept. With a disk tier (`prompt_disk`) evicted sessions, and on a clean stop the live
ones, are written to files that later requests read back, after a restart too.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ...decoding.loop import GenerationEvent
from ...decoding.prefix_marks import mark_positions, marks_bytes
from ...decoding.session import DecodingSession, PrefillCancelled, common_prefix
from ...proposers.dflash import DFlashProposer
from ...targets.model import copy_cache, copy_state

if TYPE_CHECKING:
    from .prompt_disk import PromptDisk


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
    return total + marks_bytes(session.marks)


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
        if isinstance(value, (list, set)):  # tokens, queued drafter input, marks: own lists of immutable values
            setattr(clone, name, type(value)(value))
    clone.cache = [copy_cache(c) for c in session.cache]
    clone.proposer = proposer
    clone.lookup = session.lookup.copy() if session.lookup is not None else None
    return clone


class PromptCache:
    def __init__(self, max_bytes: int, new_session: Callable[[], DecodingSession], openers: set[int] | None = None):
        self.max_bytes = max_bytes
        self.new_session = new_session
        self.openers = openers or set()  # the tokens that open a chat message: marks go before them
        self._entries: OrderedDict[int, tuple[DecodingSession, int]] = OrderedDict()
        self._next_key = 0
        # Kept as a running total: other threads (/health) read it while the worker evicts.
        self.nbytes = 0
        # The disk tier (`prompt_disk`): evicted sessions are written there, and read back when a
        # file serves a prompt better than memory does. None: memory only.
        self.disk: PromptDisk | None = None

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
        if self.disk is not None:
            found = self._from_disk(prompt, best[0] if best is not None else 0)
            if found is not None:
                return found
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
        return _resumed(session, keep, prompt)

    def _from_disk(self, prompt: list[int], memory: int) -> tuple[DecodingSession, int] | None:
        """`fetch`'s answer from the disk tier, when a file keeps enough more of `prompt` than
        memory's best (`memory` tokens) to be worth reading; rolled back as a memory hit's copy."""
        found = self.disk.best(prompt, memory)
        session = self.disk.load(found[1], self.new_session) if found is not None else None
        if session is None:
            return None
        return _resumed(session, found[0], prompt)

    def mark(self, session: DecodingSession, new: list[int]) -> None:
        """Before `new` (the prompt after the session's tokens) is fed to a session that cannot be
        rolled back: mark where its messages open and two tokens before its end. So the same prompt
        asked again (a retry, a regenerated reply) or gone on from with a re-rendered reply computes
        only its last positions, and a prompt sharing its system prompt and tools reuses them."""
        if self.max_bytes <= 0 or session.rewindable:
            return
        prompt = session.tokens + new
        marks = set(mark_positions(prompt, len(session.tokens), self.openers))
        if len(prompt) - 2 >= len(session.tokens):
            marks.add(len(prompt) - 2)
        session.mark_at = marks

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
            key = next(iter(self._entries))
            if self.disk is not None:
                self.disk.write(self._entries[key][0])  # queued for the disk's writer thread
            self._drop(key)
            evicted = True
        if evicted:
            mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back to the system

    def _drop(self, key: int) -> None:
        _, size = self._entries.pop(key)
        self.nbytes -= size

    def persist(self) -> None:
        """Write the live sessions to the disk tier and wait for every write (a clean stop's, on
        the thread that decoded them: their arrays are evaluated there)."""
        if self.disk is not None:
            self.disk.write_all(list(self._entries.values()))

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
        mx.clear_cache()


def _resumed(session: DecodingSession, keep: int, prompt: list[int]) -> tuple[DecodingSession, int]:
    """`session` (owned by the request) rolled back to its first `keep` tokens for `prompt`, and the
    prompt positions its caches hold."""
    if keep < len(session.tokens):
        before = session.cache
        session.truncate(keep)
        if session.cache is not before:  # the drafter's window refused: recomputed from scratch
            return session, 0
    # The pending token is in no cache (the session invariant): replacing it costs nothing.
    session.tokens[-1] = prompt[keep - 1]
    return session, keep - 1


def until_cancelled(stream: Iterator[GenerationEvent]) -> Iterator[GenerationEvent]:
    """`stream`, ended early when its prefill is cancelled between chunks (`PrefillCancelled`): the
    session then holds the prompt fed so far, consistently, and is kept; the request ends cancelled."""
    try:
        yield from stream
    except PrefillCancelled:
        return
    finally:
        stream.close()  # its own cleanup (a step launched ahead dropped) before the session is stored


def recover(session: DecodingSession) -> bool:
    """Make a session that an exception left mid-cycle (or mid-prefill) consistent again: every
    trimmable cache is cut back to the committed tokens, which a cycle or a prefill only ever
    writes past; recurrent and rotating caches go back to the latest mark (and the session with
    them). False: it cannot be (no mark, another proposer), and must not be reused."""
    committed = len(session.tokens) - 1  # positions the caches hold (the pending token is in none)
    mark = None
    if not session.rewindable:
        mark = max((m for m in session.marks if m.length <= committed + 1), key=lambda m: m.length, default=None)
        if mark is None:
            return False
    proposer = session.proposer
    if committed < 1 or (proposer is not None and not isinstance(proposer, DFlashProposer)):
        return False
    try:
        session.settle()
        for i, c in enumerate(session.cache):
            if mark is not None and i in mark.states:
                c.state = copy_state(mark.states[i])  # whatever the error left there
                continue
            if c.offset < committed:
                return False
            c.trim(c.offset - committed)
        if proposer is not None:
            extra = proposer.cache.offset + session.pending_positions - committed
            if extra < 0:
                return False
            proposer.trim(extra)
        if mark is not None:
            session.truncate(mark.length)  # the trimmable caches and the drafter follow the mark
    except Exception:  # a window that cannot give back positions, or state the error broke
        return False
    return True


def _usable_length(session: DecodingSession, prompt: list[int]) -> int | None:
    """How many of the session's tokens a request for `prompt` can keep (None: no use).

    Kept tokens but the last must equal the prompt's (that last one, pending, can be swapped),
    at least one prompt token must remain to be fed, and keeping fewer than the session has
    needs caches that can be trimmed, or a mark of that length.
    """
    keep = min(common_prefix(session.tokens, prompt) + 1, len(session.tokens), len(prompt) - 1)
    keep = session.reachable(keep)  # a recurrent or rotating cache goes back only to a mark
    return keep if keep >= 2 else None


def describe(cache: PromptCache) -> dict[str, Any]:
    disk = cache.disk.describe() if cache.disk is not None else None
    return {"entries": len(cache), "bytes": cache.nbytes, "max_bytes": cache.max_bytes, "disk": disk}
