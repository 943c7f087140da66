"""Streamed text with stop strings held back until they are decided.

A stop string can be split across tokens and verify cycles. The filter never
releases a character that could still begin a stop string, so a stop string is
never streamed. (Reasoning and tool-call markup are read on the HTTP side: `reply`.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Released:
    text: str  # text that is safe to stream now
    stop: str | None = None  # the stop string that ended the text


class TextFilter:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.released = ""  # all text released so far
        self.stopped: str | None = None

    def push(self, segment: str) -> Released:
        if self.stopped is not None:
            return Released("", self.stopped)
        self.pending += segment
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            index, word = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            text = self.pending[:index]
            self.pending = ""
            self.released += text
            self.stopped = word
            return Released(text, word)
        hold = partial_suffix(self.pending, self.stops)
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(text):]
        self.released += text
        return Released(text)

    def flush(self) -> str:
        """At the end of generation: release what was held back (no stop string completed)."""
        text, self.pending = self.pending, ""
        self.released += text
        return text


def partial_suffix(text: str, words: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`."""
    longest = 0
    for word in words:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if text.endswith(word[:n]):
                longest = n
                break
    return longest
