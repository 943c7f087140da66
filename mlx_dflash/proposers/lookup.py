"""Prompt lookup: proposals read off the context, with no drafter.

The last n committed tokens (n from `max_ngram` down to `min_ngram`, the longest that
matches) are looked up among the earlier n-grams of the prompt and the reply so far; the
tokens that followed the most recent earlier occurrence are proposed. A match whose
continuation runs into the present (a loop, a repeated line) is read as a period and
continued along it. The target verifies the proposal like any block: a proposed token is
kept only where it equals the target's own token (greedy or sampled), so output is exact.

The index is incremental: each committed position is indexed once, when the token after
it commits, and a rollback (`truncate`) unindexes only the positions it drops. Its memory
(Python objects, a few hundred bytes per token) is kept as a running estimate, `nbytes`, which
the server's prompt cache counts against its budget.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

LOOKUP_BLOCK = 16  # prompt lookup's widest block (15 proposed tokens)
# CPython's cost of the index, estimated: a new n-gram is a tuple, a list and a dict slot; each
# indexed position adds a list slot per n-gram and one int object shared by them.
GRAM_BYTES = 200
ENTRY_BYTES = 20


class PromptLookup:
    """An n-gram index over one session's committed tokens (the session owns the tokens)."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its end positions, ascending
        self._indexed = 0  # positions 0 .. _indexed - 1 are indexed (each has a follower)
        self.nbytes = 0  # the index's memory, estimated

    def _grams(self, tokens: Sequence[int], end: int):
        for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
            yield tuple(tokens[end - n + 1 : end + 1])

    def sync(self, tokens: Sequence[int]) -> None:
        """Index every position of `tokens` that has a follower and is not indexed yet."""
        grams = len(self._ends)
        for end in range(self._indexed, len(tokens) - 1):
            for gram in self._grams(tokens, end):
                self._ends.setdefault(gram, []).append(end)
                self.nbytes += ENTRY_BYTES
        self.nbytes += GRAM_BYTES * (len(self._ends) - grams)
        self._indexed = max(self._indexed, len(tokens) - 1)

    def truncate(self, tokens: Sequence[int], length: int) -> None:
        """The session keeps only `tokens[:length]` (call before dropping them)."""
        for end in range(self._indexed - 1, max(length - 1, 0) - 1, -1):
            for gram in self._grams(tokens, end):
                ends = self._ends[gram]
                ends.pop()
                self.nbytes -= ENTRY_BYTES
                if not ends:
                    del self._ends[gram]
                    self.nbytes -= GRAM_BYTES
        self._indexed = min(self._indexed, max(length - 1, 0))

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens to follow `tokens` (empty: no earlier occurrence of its suffix)."""
        self.sync(tokens)
        if limit < 1:
            return []
        last = len(tokens) - 1
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self._ends.get(tuple(tokens[last - n + 1 :]))
            if ends:
                end = ends[-1]
                period = last - end  # the match repeats every `period` tokens
                return [tokens[end + 1 + i % period] for i in range(limit)] if end + limit >= last \
                    else list(tokens[end + 1 : end + 1 + limit])
        return []

    def copy(self) -> PromptLookup:
        clone = copy.copy(self)
        clone._ends = {gram: list(ends) for gram, ends in self._ends.items()}
        return clone
