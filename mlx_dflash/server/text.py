"""Streamed text with stop strings and tool-call markers held back until they are decided.

A stop string can be split across tokens and verify cycles. The filter never
releases a character that could still begin a stop string or a tool-call marker,
so a stop string is never streamed, and tool-call markup never reaches `content`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Released:
    text: str  # text that is safe to stream now
    stop: str | None = None  # the stop string that ended the text
    captured: bool = False  # a tool-call marker started: the rest is tool-call markup


class TextFilter:
    def __init__(self, stops: list[str], capture_marker: str | None = None):
        self.stops = [s for s in stops if s]
        self.marker = capture_marker
        self.pending = ""
        self.released = ""  # all text released so far
        self.captured: str | None = None  # tool-call markup, once the marker was seen
        self.stopped: str | None = None

    def _watched(self) -> list[str]:
        return self.stops + ([self.marker] if self.marker and self.captured is None else [])

    def push(self, segment: str) -> Released:
        if self.stopped is not None:
            return Released("", self.stopped)
        if self.captured is not None:
            return self._push_captured(segment)
        self.pending += segment
        hits = [(self.pending.find(s), s) for s in self._watched() if s in self.pending]
        if hits:
            index, word = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            text, rest = self.pending[:index], self.pending[index + len(word):]
            self.pending = ""
            self.released += text
            if word == self.marker and word not in self.stops:
                self.captured = ""
                tail = self._push_captured(rest)
                return Released(text, tail.stop, True)
            self.stopped = word
            return Released(text, word)
        hold = _partial_suffix(self.pending, self._watched())
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(text):]
        self.released += text
        return Released(text)

    def _push_captured(self, segment: str) -> Released:
        self.captured += segment
        for stop in self.stops:
            if stop in self.captured:
                self.captured = self.captured[: self.captured.index(stop)]
                self.stopped = stop
                return Released("", stop, True)
        return Released("", None, True)

    def flush(self) -> str:
        """At the end of generation: release what was held back (no stop string completed)."""
        text, self.pending = self.pending, ""
        if self.captured is not None:
            self.captured += text
            return ""
        self.released += text
        return text


def _partial_suffix(text: str, words: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`."""
    longest = 0
    for word in words:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if text.endswith(word[:n]):
                longest = n
                break
    return longest
