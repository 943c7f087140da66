"""Anthropic Messages: request validation, replies and the streaming event sequence.

Requests are read as Claude Code sends them: a system prompt as text blocks with
cache_control, system messages inside `messages`, thinking settings, earlier turns'
thinking blocks, Anthropic-defined tools next to custom ones, and fields a local
model has no use for (metadata, context_management, output_config.effort), which
are accepted and ignored. The reply's text is split into thinking, text and tool_use
blocks by the request's `ReplyParser`.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..http import fields
from ..http.errors import APIError, failure
from ..http.sse import sse_event
from ..http.state import JobStream, ServerState, dflash_extension, usage_numbers
from ..reply.events import ReasoningDelta, TextDelta, ToolCallItem
from ..reply.structured import constraint_for, format_kind, output_parser, tool_choice_constraint, without_thinking
from ..reply.tools import template_tool_call
from ..worker.jobs import Finished, GenerationRequest, Step

# Blocks carrying images or files: a text model cannot read them.
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")
BLOCK_JOIN = "\n\n"  # between text blocks of one system prompt, message or tool result
# Claude Code opens its system prompt with a billing line for Anthropic's API (a client version and
# a per-session suffix), not an instruction: kept, it would make every session's prompt differ a few
# tokens in, so no session could reuse another's cached system prompt and tools.
BILLING_HEADER = "x-anthropic-billing-header:"


@dataclass
class Options:
    """What shapes the reply, beyond what the engine generates."""

    stream: bool = False
    parser: Any = None  # the request's ReplyParser (structured.PlainReply for constrained JSON)
    show_thinking: bool = True  # thinking.display "omitted": thinking blocks carry only their signature
    context_bound: bool = False  # the context window, not max_tokens, bounds the reply


# -- requests -------------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise fields.bad(where, f"'{where}' must be a string or an array of content blocks")
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise fields.bad(f"{where}.{i}", f"'{where}.{i}' must be a content block with a 'type'")
        if kind in MEDIA_BLOCKS:
            raise fields.bad(f"{where}.{i}", f"'{where}.{i}' is a {kind} block: this server serves a text model, "
                             "send text blocks only")
    return content


def _text_of(content: Any, where: str) -> str:
    """The text of a system prompt or tool result: a string or text blocks (cache_control and the like ignored)."""
    if content is None:
        return ""
    texts = []
    for i, block in enumerate(_blocks(content, where)):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise fields.bad(f"{where}.{i}", f"'{where}.{i}' must be a text block here")
        texts.append(block["text"])
    return BLOCK_JOIN.join(texts)


def _without_billing(system: Any) -> Any:
    """The `system` field without Claude Code's billing line (`BILLING_HEADER`)."""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    if isinstance(system, list):
        return [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]
    return system


def _tool_result(block: dict, where: str) -> dict:
    result = block.get("content")
    text = result if isinstance(result, str) else _text_of(result, f"{where}.content")
    if block.get("is_error"):
        text = "Error: " + text  # the template has no slot for the flag: the model reads it in the text
    return {"role": "tool", "content": text, "tool_call_id": block.get("tool_use_id")}


def _turn(message: dict, where: str) -> list[dict]:
    """One user or assistant message as template messages (tool results become `tool` messages)."""
    role, out = message["role"], []
    text, calls, reasoning = [], [], []
    for i, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
        kind, at = block["type"], f"{where}.content.{i}"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise fields.bad(at, f"'{at}.text' must be a string")
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise fields.bad(at, f"'{at}' (tool_use) needs a name")
            call = template_tool_call(block["name"], block.get("input", {}))
            if isinstance(block.get("id"), str):
                call["id"] = block["id"]
            calls.append(call)
        elif kind == "thinking" and role == "assistant":
            # Templates that keep reasoning (Qwen3 within a tool loop) render it; others ignore the key.
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque: nothing a local model can read
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block, at))
        else:
            raise fields.bad(at, f"a {kind} block cannot appear in a {role} message here")
    if text or calls or reasoning or not message.get("content"):
        entry: dict[str, Any] = {"role": role, "content": BLOCK_JOIN.join(text)}
        if calls:
            entry["tool_calls"] = calls
        if reasoning:
            entry["reasoning_content"] = "".join(reasoning)
        out.append(entry)
    return out


def template_messages(body: dict, fold_system: bool = False) -> list[dict]:
    """The conversation as chat templates take it.

    System text (the `system` field and system messages before the first turn) leads as one
    system message; later system messages stay in place, or with `fold_system` join the
    leading one (for templates that accept a system message only first).
    """
    messages = fields.array(body, "messages", required=True)
    if not messages:
        raise fields.bad("messages", "'messages' must hold at least one message")
    system = [_text_of(_without_billing(body.get("system")), "system")] if body.get("system") else []
    out: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise fields.bad(f"{where}.role", f"'{where}.role' must be 'user', 'assistant' or 'system'")
        if message["role"] != "system":
            out.extend(_turn(message, where))
            continue
        text = _text_of(message.get("content"), f"{where}.content")
        if out and not fold_system:
            out.append({"role": "system", "content": text})
        else:
            system.append(text)
    if not any(m["role"] != "system" for m in out):
        raise fields.bad("messages", "'messages' must hold at least one user or assistant message")
    system = [s for s in system if s]
    return ([{"role": "system", "content": BLOCK_JOIN.join(system)}] if system else []) + out


def template_tools(body: dict) -> list[dict] | None:
    """Custom tools in the OpenAI shape templates take; Anthropic-defined tools (server tools such as
    web_search_20250305, client tools such as bash_20250124) have no schema to show the model: skipped."""
    converted = []
    for i, tool in enumerate(fields.array(body, "tools") or []):
        if not isinstance(tool, dict):
            raise fields.bad(f"tools.{i}", f"'tools.{i}' must be an object")
        if tool.get("type") not in (None, "custom"):
            continue
        if not isinstance(tool.get("name"), str):
            raise fields.bad(f"tools.{i}.name", f"'tools.{i}' needs a name")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise fields.bad(f"tools.{i}.input_schema", f"'tools.{i}.input_schema' must be a JSON schema object")
        converted.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""), "parameters": schema}})
    return _tool_choice(body, converted or None)


def _tool_choice(body: dict, tools: list[dict] | None) -> list[dict] | None:
    choice = body.get("tool_choice")
    if choice is None:
        return tools
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise fields.bad("tool_choice", "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'")
    if kind == "none":
        return None
    return tools


def _forced_tool(body: dict) -> tuple[bool, str | None, bool]:
    """Whether `tool_choice` forces a call ('any', or 'tool' with its name), the tool it names, and whether
    several calls may follow (not `disable_parallel_tool_use`)."""
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("any", "tool"):
        return False, None, True
    name = choice.get("name") if kind == "tool" else None
    if kind == "tool" and not isinstance(name, str):
        raise fields.bad("tool_choice", "'tool_choice' of type 'tool' needs the tool's 'name'")
    return True, name, not choice.get("disable_parallel_tool_use")


def _thinking(body: dict) -> tuple[dict, bool]:
    """Template options for `thinking` (enable_thinking: mlx-lm's wrapper maps it to a template's own name)
    and whether thinking text is shown."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}, True
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING_TYPES:
        raise fields.bad("thinking", f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}")
    if kind == "enabled":
        fields.integer(thinking, "budget_tokens", None, low=1)  # accepted; generation is bounded by max_tokens
    display = thinking.get("display") or "summarized"
    if display not in ("summarized", "omitted"):
        raise fields.bad("thinking", "'thinking.display' must be 'summarized' or 'omitted'")
    return {"enable_thinking": kind != "disabled"}, display != "omitted"


def _output_format(body: dict) -> tuple[str, dict | None, str]:
    """`output_config.format` (or the older `output_format`) as (kind, JSON schema, its field name)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise fields.bad("output_config", "'output_config' must be an object")
    value, param = (config or {}).get("format"), "output_config.format"
    if value is None:
        value, param = body.get("output_format"), "output_format"
    return *format_kind(value, param), param


def _prompt(state: ServerState, body: dict) -> tuple[list[int], list[dict] | None]:
    """The rendered prompt and the custom tools offered (OpenAI shape), for generation and count_tokens alike."""
    state.check_model(fields.string(body, "model"))
    tools = template_tools(body)
    options, _ = _thinking(body)
    forced = _forced_tool(body)[0]
    if forced and options.get("enable_thinking"):
        # As Anthropic's API: the call grammar leaves no room for thinking, so the two cannot be combined.
        raise fields.bad("thinking", "thinking cannot be enabled when 'tool_choice' forces a tool call "
                         "('any' or 'tool'): disable thinking or use 'tool_choice' 'auto'")
    if forced or _output_format(body)[0] != "text":
        options = without_thinking(options)  # the grammar allows the JSON (or the calls) alone
    messages = template_messages(body)
    try:
        return state.render(messages, tools, options), tools
    except APIError:
        folded = template_messages(body, fold_system=True)
        if folded == messages:
            raise
        # The template refused a system message after the first turn: it joins the leading system prompt.
        return state.render(folded, tools, options), tools


def count_request(state: ServerState, body: dict) -> list[int]:
    fields.unicode_text(body, brackets=False)
    return _prompt(state, body)[0]


def messages_request(state: ServerState, body: dict) -> tuple[GenerationRequest, Options]:
    fields.unicode_text(body, brackets=False)
    max_tokens = fields.integer(body, "max_tokens", None, low=1)
    if max_tokens is None:
        raise APIError(400, "'max_tokens' is required", param="max_tokens")
    prompt, tools = _prompt(state, body)
    _, show_thinking = _thinking(body)
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=state.budget(prompt, max_tokens),
        temperature=fields.temperature(body, "temperature", state.temperature_default, 1.0),
        top_p=fields.top_p(body, "top_p"),
        top_k=fields.top_k(body, "top_k", state.engine.target.vocab_size),
        stops=fields.stop_strings(body, "stop_sequences", limit=64),
    )
    request.constraint = constraint_for(state, *_output_format(body))
    forced, name, parallel = _forced_tool(body)
    if forced:  # the reply is the call(s) alone: the call grammar replaces any output format
        request.constraint = tool_choice_constraint(state, tools, name, "tool_choice", parallel)
    parser = output_parser(state, prompt, tools, "toolu_", forced=forced, constrained=request.constraint is not None)
    return request, Options(fields.boolean(body, "stream"), parser, show_thinking,
                            state.context_bound(prompt, max_tokens))


# -- replies --------------------------------------------------------------------------------
def _signature(thinking: str) -> str:
    """A thinking block's signature: clients send it back unchanged; it names the text it came with."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


class ContentBlocks:
    """A reply's content blocks, built from the parser's items in order, with the stream events that build them."""

    def __init__(self, show_thinking: bool = True):
        self.content: list[dict] = []
        self.open: str | None = None  # the type of the last block while it can still grow
        self.show_thinking = show_thinking
        self.thinking: list[str] = []  # the open thinking block's text

    def _start(self, block: dict) -> list[dict]:
        events = self._close()
        self.content.append(block)
        self.open = block["type"]
        return events + [{"type": "content_block_start", "index": len(self.content) - 1,
                          "content_block": dict(block)}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        index, block, events = len(self.content) - 1, self.content[-1], []
        if self.open == "thinking":
            text = "".join(self.thinking)
            block["signature"] = _signature(text)
            if self.show_thinking:
                block["thinking"] = text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        self.open = None
        return events + [{"type": "content_block_stop", "index": index}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def push(self, item: Any) -> list[dict]:
        if isinstance(item, TextDelta):
            return self._text(item.text)
        if isinstance(item, ReasoningDelta):
            if not item.text:
                return []
            events = []
            if self.open != "thinking":
                events = self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.thinking = []
            self.thinking.append(item.text)
            if self.show_thinking:
                events.append(self._delta({"type": "thinking_delta", "thinking": item.text}))
            return events
        if isinstance(item, ToolCallItem):
            events = self._start({"type": "tool_use", "id": item.id, "name": item.name, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": item.arguments_json}))
            self.content[-1]["input"] = item.arguments
            return events + self._close()
        raise TypeError(f"unexpected reply item {item!r}")

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        self.content[-1]["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def finish(self) -> list[dict]:
        """Close the last block; a reply with no content gets one empty text block."""
        if self.content:
            return self._close()
        return self._start({"type": "text", "text": ""}) + self._close()

    @property
    def tool_use(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.content)


def _items(options: Options, text: str) -> list:
    return options.parser.feed(text) if text else []


def _stop_reason(finished: Finished, tool_use: bool, options: Options) -> str:
    error = failure(finished.finish_reason, finished.error)
    if error is not None:
        raise error
    if tool_use:
        return "tool_use"
    if finished.stop is not None:
        return "stop_sequence"
    if finished.finish_reason != "length":
        return "end_turn"
    # Out of context is not out of budget: Claude Code compacts on the one and reports its own limit on the other.
    return "model_context_window_exceeded" if options.context_bound else "max_tokens"


def _usage(request: GenerationRequest, finished: Finished) -> dict:
    prompt, completion, cached = usage_numbers(request, finished)
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def reply(state: ServerState, request: GenerationRequest, options: Options, steps: list[Step],
          finished: Finished) -> dict:
    blocks = ContentBlocks(options.show_thinking)
    for step in steps:
        for item in _items(options, step.text):
            blocks.push(item)
    for item in options.parser.finish():
        blocks.push(item)
    blocks.finish()
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": state.model_id,
            "content": blocks.content, "stop_reason": _stop_reason(finished, blocks.tool_use, options),
            "stop_sequence": finished.stop, "usage": _usage(request, finished),
            "dflash": dflash_extension(state, finished)}


async def stream(
    state: ServerState, request: GenerationRequest, options: Options, job: JobStream
) -> AsyncIterator[str]:
    def event(data: dict) -> str:
        return sse_event(data, data["type"])

    message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": state.model_id,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(request.prompt), "output_tokens": 0,
                         "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}
    yield event({"type": "message_start", "message": message})
    blocks = ContentBlocks(options.show_thinking)
    async for item in job:
        if isinstance(item, Step):
            for part in _items(options, item.text):
                for data in blocks.push(part):
                    yield event(data)
            continue
        error = failure(item.finish_reason, item.error)
        if error is not None:
            yield event(error.anthropic_body())
            return
        for part in options.parser.finish():
            for data in blocks.push(part):
                yield event(data)
        for data in blocks.finish():
            yield event(data)
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": _stop_reason(item, blocks.tool_use, options), "stop_sequence": item.stop},
                     "usage": _usage(request, item), "dflash": dflash_extension(state, item)})
        yield event({"type": "message_stop"})
