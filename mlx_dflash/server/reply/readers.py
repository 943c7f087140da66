"""The family readers behind `ReplyParser`: each turns one model family's streamed markup into events.

`MarkedReader` reads calls between a start and an end marker (mlx-lm's tool parsers: Hermes/Qwen
JSON, Qwen3-Coder XML, Mistral, ...) and thinking between its own markers; `LlamaReader` reads
Llama 3.x bare-JSON calls (optionally after `<|python_tag|>`); `HarmonyReader` reads gpt-oss
(harmony) channels. They hold back text that may still begin a marker (`_scan`) and find where a
streamed JSON object ends (`_JsonExtent`). They are kept apart from parser.py, which picks the format
and the reader, because the incremental scanning is a job of its own; they see the parser they
serve only as a `ReplySink` (its format, its tools and `calls_from`), so this module imports
nothing of parser.py.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from ..worker.text import partial_suffix
from .events import Event, ReasoningDelta, TextDelta, ToolCallItem

PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: a call follows
# gpt-oss (harmony): a message is `<|start|>ROLE<|channel|>CHANNEL [to=RECIPIENT] ...<|message|>BODY<|end|>`.
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")


class ReplySink(Protocol):
    """What a reader reads of the parser it serves (`parser.ReplyParser`)."""

    fmt: Any  # the model's `parser.ReplyFormat`
    tools: list[dict] | None  # the request's tools (None: call markup stays text)

    def calls_from(self, parsed: Any) -> list[ToolCallItem] | None:
        """The calls in one tool-parser result (a call or a list of them), recorded; None if any is no call."""
        ...


def _scan(buffer: str, markers: list[str], hold_space: bool = True) -> tuple[str, str | None, str]:
    """Split `buffer` at its first marker: (text before, marker, text after). With no marker in it:
    (the text safe to release, None, the held tail that may still begin a marker). With `hold_space`,
    trailing whitespace waits too: just before a marker it is markup spacing."""
    hits = [(buffer.find(m), -len(m), m) for m in markers if m and m in buffer]
    if hits:
        index, _, marker = min(hits)
        return buffer[:index], marker, buffer[index + len(marker):]
    if not markers:
        return buffer, None, ""
    release = buffer[: len(buffer) - partial_suffix(buffer, markers)]
    if hold_space:
        release = release.rstrip()
    return release, None, buffer[len(release):]


class _JsonExtent:
    """Where the JSON object that opens a text ends, read incrementally (each character once)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.read = 0, False, False, 0

    def end(self, text: str) -> int | None:
        """The index just past the object in `text` (the same text, grown), or None while it is open."""
        for i in range(self.read, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.read = i + 1
                    return i + 1
        self.read = len(text)
        return None


class MarkedReader:
    """Calls between a start and an end marker (Hermes/Qwen JSON, Qwen3-Coder XML, ...); thinking between its own."""

    def __init__(self, parser: ReplySink, reasoning: bool):
        self.parser = parser
        self.fmt = parser.fmt
        self.mode = "reasoning" if reasoning and self.fmt.think_end else "text"
        self.pending = ""
        self.body = ""  # the call being read, markers excluded
        self.strip = self.mode == "reasoning"  # whitespace right after a marker is markup spacing
        self.gap = ""  # the whitespace dropped before the call being read: given back if it is no call

    def _markers(self) -> list[str]:
        fmt = self.fmt
        if self.mode == "reasoning":
            return [fmt.think_end]
        if self.mode == "call":
            return [fmt.tool_end] if fmt.tool_end else []
        markers = [fmt.think_start] if fmt.think_start else []
        if self.parser.tools and fmt.tool_start and fmt.tool_parser is not None:
            markers.append(fmt.tool_start)
        return markers

    def _emit(self, text: str, out: list[Event]) -> None:
        if self.mode == "call":
            self.body += text
            return
        if self.strip:
            text = text.lstrip()
            self.strip = not text
        if text:
            out.append(ReasoningDelta(text) if self.mode == "reasoning" else TextDelta(text))

    def _advance(self, out: list[Event]) -> str | None:
        """Release `pending` up to its first marker (whitespace just before one is dropped); the marker."""
        spacing = self.mode != "call"
        before, marker, self.pending = _scan(self.pending, self._markers(), hold_space=spacing)
        if marker is not None and spacing:
            kept = before.rstrip()
            self.gap = "" if self.strip and not kept else before[len(kept):]
            before = kept
        self._emit(before, out)
        return marker

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        while (marker := self._advance(out)) is not None:
            self._switch(marker, out)
        return out

    def _switch(self, marker: str, out: list[Event]) -> None:
        fmt = self.fmt
        if self.mode == "call":
            self._close_call(out, ended=True)
        elif self.mode == "reasoning":
            self.mode, self.strip = "text", True
        elif marker == fmt.think_start:
            self.mode, self.strip = "reasoning", True
        else:
            self.mode, self.body = "call", ""

    def _close_call(self, out: list[Event], ended: bool) -> None:
        fmt = self.fmt
        try:
            parsed = fmt.tool_parser(self.body, self.parser.tools)
        except Exception:  # each mlx-lm parser raises its own errors on markup that is no call
            parsed = None
        calls = self.parser.calls_from(parsed) if parsed is not None else None
        self.mode = "text"
        if calls is None:
            out.append(TextDelta(self.gap + fmt.tool_start + self.body + (fmt.tool_end if ended else "")))
            self.strip = False
        else:
            out.extend(calls)
            self.strip = True
        self.body = ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self.pending = self.pending, ""
        if self.mode == "call":
            self.body += rest
            self._close_call(out, ended=False)
        else:
            self._emit(rest, out)
        return out


class LlamaReader(MarkedReader):
    """Llama 3.x: a reply that opens with a JSON object (or has `<|python_tag|>` before one) is a call,
    `{"name": ..., "parameters": {...}}`; several are separated by `;` or whitespace."""

    def __init__(self, parser: ReplySink, reasoning: bool):
        super().__init__(parser, reasoning)
        self.tagged = False  # the object being read followed <|python_tag|>
        self.drop_gap = False  # the whitespace and `;` before the next text are markup (after a call or thinking)
        self.extent = _JsonExtent()  # of the object being read
        if parser.tools and self.mode == "text":
            self.mode = "between"  # the reply's start: a call may open here

    def _markers(self) -> list[str]:
        if self.mode == "text" and self.parser.tools:
            return ([self.fmt.think_start] if self.fmt.think_start else []) + [PYTHON_TAG]
        return super()._markers()

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Event]) -> bool:
        """Read what `pending` allows; True while more may be read now."""
        if self.mode == "between":
            gap = len(self.pending) - len(self.pending.lstrip(" \t\r\n;"))
            head = self.pending[gap:]
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return False  # undecided: wait for more
            if head.startswith("{"):
                self.pending, self.mode, self.extent = head, "object", _JsonExtent()
                return True
            if head.startswith(PYTHON_TAG):
                self.pending, self.mode, self.tagged, self.gap = head[len(PYTHON_TAG):], "tag", True, ""
                return True
            self.mode = "text"
            if self.drop_gap:
                self.pending, self.strip = head, True
            return True
        if self.mode == "tag":  # after <|python_tag|>: a JSON call, or code for a built-in tool (text)
            head = self.pending.lstrip()
            if not head:
                return False
            if head.startswith("{"):
                self.pending, self.mode, self.extent = head, "object", _JsonExtent()
            else:
                out.append(TextDelta(self.gap + PYTHON_TAG))
                self.mode, self.tagged = "text", False
            return True
        if self.mode == "object":
            end = self.extent.end(self.pending)
            if end is None:
                return False
            self._close_object(self.pending[:end], out)
            self.pending = self.pending[end:]
            return True
        marker = self._advance(out)
        if marker is None:
            return False
        if marker == PYTHON_TAG and self.mode == "text":
            self.mode, self.tagged = "tag", True
        elif self.mode == "reasoning" and self.parser.tools:  # the answer after thinking may open with a call
            self.mode, self.drop_gap = "between", True
        else:
            self._switch(marker, out)
        return True

    def _close_object(self, raw: str, out: list[Event]) -> None:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = None
        calls = self.parser.calls_from(parsed) if parsed is not None else None
        if calls is None:
            out.append(TextDelta((self.gap + PYTHON_TAG if self.tagged else "") + raw))
        else:
            out.extend(calls)
        self.drop_gap, self.tagged, self.mode = calls is not None, False, "between"

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self.pending = self.pending, ""
        if self.mode in ("object", "tag"):
            out.append(TextDelta((self.gap + PYTHON_TAG if self.tagged else "") + rest))
        elif self.mode == "between":
            if not self.drop_gap:
                out.append(TextDelta(rest))
        else:
            self._emit(rest, out)
        return out


class HarmonyReader:
    """gpt-oss: messages on channels. `analysis` is reasoning, `final` and plain `commentary` are answer
    text, and a message addressed `to=functions.NAME` is a call whose body is the JSON arguments."""

    def __init__(self, parser: ReplySink, reasoning: bool):
        self.parser = parser
        self.pending = ""
        self.mode = "message" if reasoning else "header"
        self.channel, self.recipient = ("analysis" if reasoning else "final"), None
        self.body = ""

    def _kind(self) -> str:
        if self.recipient is not None and self.parser.tools:
            return "call"
        return "reasoning" if self.channel == "analysis" else "text"

    def _emit(self, text: str, out: list[Event]) -> None:
        kind = self._kind()
        if kind == "call":
            self.body += text
        elif text:
            out.append(ReasoningDelta(text) if kind == "reasoning" else TextDelta(text))

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        while True:
            if self.mode == "header":
                head = self.pending.lstrip()
                if head and not (head.startswith("<|") or "<|".startswith(head)):
                    # Text without channel markup: answer text, as it is.
                    self.mode, self.channel, self.recipient = "message", "final", None
                    continue
                index = self.pending.find(H_MESSAGE)
                if index < 0:
                    return out
                header, self.pending = self.pending[:index], self.pending[index + len(H_MESSAGE):]
                channel = _H_CHANNEL_NAME.search(header)
                recipient = _H_RECIPIENT.search(header)
                self.channel = channel.group(1) if channel else "final"
                self.recipient = recipient.group(1) if recipient else None
                self.mode, self.body = "message", ""
                continue
            before, marker, rest = _scan(self.pending, [*H_ENDS, H_START], hold_space=False)
            self._emit(before, out)
            self.pending = rest
            if marker is None:
                return out
            self._end_message(out)
            if marker == H_START:
                self.pending = H_START + self.pending

    def _end_message(self, out: list[Event]) -> None:
        if self._kind() == "call":
            name = self.recipient.removeprefix("functions.")
            try:
                arguments = json.loads(self.body) if self.body.strip() else {}
            except json.JSONDecodeError:
                arguments = None
            calls = self.parser.calls_from({"name": name, "arguments": arguments}) if arguments is not None else None
            if calls is None:
                out.append(TextDelta(self.body))
            else:
                out.extend(calls)
        self.mode, self.channel, self.recipient, self.body = "header", "final", None, ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self.pending = self.pending, ""
        if self.mode == "message":
            self._emit(rest, out)
            self._end_message(out)  # <|call|> and <|return|> end generation: they never reach the text
        return out
