"""A reply's streamed text split into answer text, reasoning and tool calls, in the model's own format.

Every chat API (chat completions, Messages, Responses) feeds the engine's stop-filtered text
through one `ReplyParser` per request and renders its events in its own shape. The format
is read off the tokenizer: mlx-lm's TokenizerWrapper infers the thinking markers and a tool
parser (`mlx_lm.tool_parsers`: Hermes/Qwen JSON, Qwen3-Coder XML, Mistral, pythonic, ...),
which is reused as is; Llama 3.x JSON calls and gpt-oss (harmony) channels, which mlx-lm
does not parse, are read by this project's own readers (readers.py). This module holds
the format detection (`ReplyFormat`) and the parser that drives a reader; the events it yields
are in events.py. Markup that does not parse as a call stays visible text, and never takes
other calls with it.
"""

from __future__ import annotations

import importlib
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .events import Event, ReasoningDelta, TextDelta, ToolCallItem, new_call_id
from .readers import H_CHANNEL, H_MESSAGE, PYTHON_TAG, HarmonyReader, LlamaReader, MarkedReader

# Thinking spans in chat templates, for tokenizers whose vocabulary does not hold them as tokens.
THINK_PAIRS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>"))


@dataclass
class ReplyFormat:
    """How one model marks reasoning and tool calls.

    `style` picks the reader: "marked" (a start and an end marker around each call, parsed by
    `tool_parser`, mlx-lm's `parse_tool_call(text, tools)`), "llama3_json" (a bare JSON object,
    optionally after `<|python_tag|>`) or "harmony" (gpt-oss channels; reasoning is the analysis channel).
    """

    style: str = "marked"
    think_start: str | None = None
    think_end: str | None = None
    tool_start: str | None = None
    tool_end: str | None = None  # "" (Mistral): a call runs to the end of the reply
    tool_parser: Callable[..., Any] | None = None
    tool_format: str | None = None  # which parser, for messages and logs

    @classmethod
    def of(cls, tokenizer: Any) -> ReplyFormat:
        """The format of `tokenizer` (an mlx-lm TokenizerWrapper, or any tokenizer with a chat template)."""
        try:
            cached = _FORMATS.get(tokenizer)
        except TypeError:  # not weakly referenceable
            return _read_format(tokenizer)
        if cached is None:
            cached = _FORMATS[tokenizer] = _read_format(tokenizer)
        return cached

    def opens_in_reasoning(self, prompt_text_tail: str) -> bool:
        """Whether the rendered prompt ends inside a thinking span, so the reply starts as reasoning.

        Only a span opened at the very end counts (templates that think end with the opening
        marker): a marker quoted earlier in the conversation does not.
        """
        tail = prompt_text_tail.rstrip()
        if self.style == "harmony":
            return bool(re.search(r"<\|channel\|>\s*analysis\s*<\|message\|>$", tail))
        return bool(self.think_start) and tail.endswith(self.think_start)


_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _chat_template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one that renders tools, else the default
        template = template.get("tool_use") or template.get("default") or ""
    return template if isinstance(template, str) else ""


def _vocab(tokenizer: Any) -> dict:
    try:
        return tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary API: the template alone decides
        return {}


def _mlx_lm_tool_parser(name: str) -> tuple[Callable[..., Any], str, str]:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return module.parse_tool_call, module.tool_call_start, module.tool_call_end


def _read_format(tokenizer: Any) -> ReplyFormat:
    template = _chat_template(tokenizer)
    vocab = _vocab(tokenizer)
    if (H_CHANNEL in template and H_MESSAGE in template) or (H_CHANNEL in vocab and H_MESSAGE in vocab):
        return ReplyFormat("harmony", tool_format="harmony")
    think_start = getattr(tokenizer, "think_start", None)
    think_end = getattr(tokenizer, "think_end", None)
    if not (think_start and think_end):
        think_start = think_end = None
        for start, end in THINK_PAIRS:
            if start in template and end in template:
                think_start, think_end = start, end
                break
    fmt = ReplyFormat(think_start=think_start, think_end=think_end)
    parser = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if parser is not None and start:
        fmt.tool_parser, fmt.tool_start = parser, start
        fmt.tool_end = getattr(tokenizer, "tool_call_end", None) or ""
        fmt.tool_format = getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None
        return fmt
    # mlx-lm found no parser (or this is a bare tokenizer): read the template's own markup.
    name = None
    if "<tool_call>" in template:
        name = "qwen3_coder" if re.search(r"<tool_call>(\\n|\n)<function=", template) else "json_tools"
    elif PYTHON_TAG in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        fmt.style, fmt.tool_format = "llama3_json", "llama3_json"
        return fmt
    if name is not None:
        fmt.tool_parser, fmt.tool_start, fmt.tool_end = _mlx_lm_tool_parser(name)
        fmt.tool_format = name
    return fmt


def _call_fields(item: Any) -> tuple[str, dict] | None:
    """(name, arguments) of one parsed call, or None when it is not a call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some templates render the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return (item["name"], arguments) if isinstance(arguments, dict) else None


class ReplyParser:
    """One request's reply, fed as the engine releases it; yields text, reasoning and tool-call events.

    `tools`: OpenAI-shape function tools, or None (tool markup then stays text); `reasoning`:
    generation starts inside a thinking span (the prompt opened it).
    """

    def __init__(self, fmt: ReplyFormat, *, tools: list[dict] | None, reasoning: bool = False,
                 call_id_prefix: str = "call_"):
        self.fmt = fmt
        self.tools = tools or None
        self.prefix = call_id_prefix
        self.calls: list[ToolCallItem] = []
        reader = {"harmony": HarmonyReader, "llama3_json": LlamaReader}.get(fmt.style, MarkedReader)
        self._reader = reader(self, reasoning)
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished or not text:
            return []
        return _merge(self._reader.feed(text))

    def finish(self) -> list[Event]:
        """End of generation: what was held back, and a call cut short kept as text."""
        if self._finished:
            return []
        self._finished = True
        return _merge(self._reader.finish())

    def calls_from(self, parsed: Any) -> list[ToolCallItem] | None:
        """Calls from one parser result (a call or a list of them); None if any is not a call."""
        items = parsed if isinstance(parsed, list) else [parsed]
        fields = [_call_fields(item) for item in items]
        if not items or any(f is None for f in fields):
            return None
        calls = [ToolCallItem(new_call_id(self.prefix), name, arguments) for name, arguments in fields]
        self.calls.extend(calls)
        return calls


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent deltas of one kind joined, empty ones dropped."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            if not event.text:
                continue
            if out and type(out[-1]) is type(event):
                out[-1] = type(event)(out[-1].text + event.text)
                continue
        out.append(event)
    return out


def reply_parser(state: Any, prompt: list[int], tools: list[dict] | None, call_id_prefix: str) -> ReplyParser:
    """The parser for one chat request: the served model's format, starting as reasoning when
    the rendered prompt opened a thinking span."""
    tokenizer = state.tokenizer
    fmt = ReplyFormat.of(tokenizer)
    reasoning = False
    if fmt.think_start or fmt.style == "harmony":
        try:
            tail = tokenizer.decode(prompt[-32:])
        except Exception:  # a tokenizer that cannot decode a slice: the reply starts as text
            tail = ""
        reasoning = fmt.opens_in_reasoning(tail)
    return ReplyParser(fmt, tools=tools, reasoning=reasoning, call_id_prefix=call_id_prefix)
