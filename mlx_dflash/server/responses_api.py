"""OpenAI Responses (`POST /v1/responses`): request validation, output items and the streaming event sequence.

The server is stateless: every request carries the whole conversation (`input` items), as Codex
sends it with `store: false`. Input items become chat messages, which the chat template renders
as chat completions would (earlier reasoning items become the next assistant turn's
`reasoning_content`); the reply's text is split into reasoning, message and function-call output
items by the per-request `ReplyParser` (reply.py). Fields a local model cannot honour (`include`,
`prompt_cache_key`, `metadata`, ...) are accepted and ignored; what would silently change the
answer (`store: true`, `previous_response_id`) is refused with a 400 that says why. A forced tool call
(`tool_choice` 'required', a named tool, allowed_tools in mode 'required') is decoded under a grammar of
the model's call markup (structured.py), or refused with a 400 where the model's call format has none.

Tools: function tools are served; namespace tools are flattened into their function tools (calls
carry the namespace back); hosted tools the model cannot run here (web_search, local_shell, mcp, ...)
are left out. A custom (freeform) tool, such as Codex's apply_patch, is offered to the model as a
function with one string argument `input` (its grammar, if any, told in that argument's description,
not enforced), and a call to it comes back as a `custom_tool_call` item with that string as its input.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from . import fields
from .engine import Finished, GenerationRequest, Step
from .errors import APIError
from .openai_api import RESERVED_TEMPLATE_ARGS, _sampling, template_messages
from .reply import ReasoningDelta, ReplyParser, TextDelta, ToolCallItem, reply_parser
from .sse import sse_event
from .state import JobStream, ServerState, dflash_extension, usage_numbers
from .structured import PlainReply, constraint_for, forced_call_parser, format_kind, tool_choice_constraint

INPUT_ROLES = ("system", "developer", "user", "assistant")
# Reasoning efforts that mean "do not think" for a template with a thinking switch.
NO_THINKING = ("none", "minimal")
# Custom (freeform) tools reach the model as a function with one string argument of this name.
CUSTOM_INPUT = "input"


@dataclass
class Options:
    """What shapes the reply beyond what the engine generates."""

    stream: bool = False
    tools: list[dict] | None = None  # function tools as the template and the parser take them (chat shape)
    custom: set[str] = field(default_factory=set)  # names of custom tools: their calls become custom_tool_call
    namespaces: dict[str, str] = field(default_factory=dict)  # tool name -> the namespace it was declared in
    constrained: bool = False  # structured output: the reply is plain JSON text
    echo: dict = field(default_factory=dict)  # request settings the response object repeats
    forced: bool = False  # tool_choice forces a call: the reply is calls in the model's format


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# -- input ----------------------------------------------------------------------------------
def _part_text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """Text of a message's content: a string or an array of text parts of the given types."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise fields.bad(where, f"'{where}' must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in kinds and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise fields.bad(f"{where}[{j}]", f"'{where}[{j}]' must be a text part ({', '.join(kinds)}), got "
                             f"{kind!r}: this server serves a text model")
    return "".join(texts)


def _message_text(content: Any, where: str) -> str:
    return _part_text(content, where, ("input_text", "output_text", "text"))


def _call_arguments(item: dict, where: str) -> str:
    if item["type"] == "custom_tool_call":
        if not isinstance(item.get("input"), str):
            raise fields.bad(f"{where}.input", f"'{where}.input' must be a string")
        return json.dumps({CUSTOM_INPUT: item["input"]}, ensure_ascii=False)
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise fields.bad(f"{where}.arguments", f"'{where}.arguments' must be a JSON string")
    return arguments


def conversation(body: dict) -> tuple[list[dict], list[str | None]]:
    """Chat messages (the chat completions shape) for `instructions` and `input`, and for each message
    the reasoning text of the model's turn (reasoning items, which chat messages have no field for)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise fields.bad("instructions", "'instructions' must be a string")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' is required: a string or a non-empty array of input items", param="input",
                       code="missing_required_parameter" if items is None else "invalid_value")
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasonings: list[str | None] = [None] * len(messages)
    thought: str | None = None  # a reasoning item's text, waiting for the assistant turn it belongs to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise fields.bad(where, f"'{where}' must be an object")
        kind = item.get("type", "message")
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise fields.bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(INPUT_ROLES)}, "
                                 f"got {role!r}")
            messages.append({"role": role, "content": _message_text(item.get("content"), f"{where}.content")})
            reasonings.append(thought if role == "assistant" else None)
            thought = thought if role in ("system", "developer") else None
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str):
                raise fields.bad(f"{where}.name", f"'{where}.name' is required")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": _call_arguments(item, where)}}
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)  # the calls of one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                reasonings.append(thought)
                thought = None
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _part_text(item.get("output"), f"{where}.output", ("input_text", "output_text", "text"))
            messages.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
            reasonings.append(None)
        elif kind == "reasoning":
            parts = item.get("content") or []
            texts = [p.get("text") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)] \
                if isinstance(parts, list) else []
            thought = "".join(texts) or None
        elif kind == "item_reference":
            raise fields.bad(where, f"'{where}': item references need stored responses; this server is "
                             "stateless, so send the items themselves")
        else:
            raise fields.bad(f"{where}.type", f"'{where}.type' {kind!r} is not supported: this server takes "
                             "message, function_call, function_call_output, custom_tool_call, "
                             "custom_tool_call_output and reasoning items")
    return _merge_leading_system(messages, reasonings)


def _merge_leading_system(messages: list[dict], reasonings: list) -> tuple[list[dict], list]:
    """`instructions` plus the system/developer messages before the first turn, as one system message:
    many chat templates accept a single leading system message only."""
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        n += 1
    if n < 2:
        return messages, reasonings
    merged = {"role": "system", "content": "\n\n".join(m["content"] for m in messages[:n] if m["content"])}
    return [merged] + messages[n:], [None] + reasonings[n:]


# -- tools ----------------------------------------------------------------------------------
def _custom_as_function(tool: dict) -> dict:
    """A custom (freeform) tool offered as a function taking its free-form input as one string (the model
    is told a grammar, when the tool has one, but not held to it)."""
    described = "The tool's input, as free-form text."
    grammar = tool.get("format")
    if isinstance(grammar, dict) and grammar.get("type") == "grammar" and isinstance(grammar.get("definition"), str):
        described += f" It follows this {grammar.get('syntax', '')} grammar:\n{grammar['definition']}"
    return {"name": tool["name"], "description": tool.get("description") or "",
            "parameters": {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": described}},
                           "required": [CUSTOM_INPUT]}}


def _function(tool: dict) -> dict:
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return function


def parse_tools(body: dict) -> tuple[list[dict], list[dict], set[str], dict[str, str]]:
    """The function and custom tools (namespaces flattened), as chat-shape functions, as the request gave
    them, the custom tools' names and each namespaced tool's namespace. Hosted tools the model cannot run
    here (web_search, local_shell, mcp, ...) are left out rather than refused: clients send them routinely."""
    given = fields.array(body, "tools") or []
    functions, served, custom, namespaces = [], [], set(), {}

    def add(tool: dict, where: str, namespace: str | None) -> None:
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise fields.bad(f"{where}.name", f"'{where}.name' is required")
        if any(f["function"]["name"] == tool["name"] for f in functions):
            raise fields.bad(where, f"'{where}': there is another tool named {tool['name']!r}")
        if tool["type"] == "custom":
            custom.add(tool["name"])
            functions.append({"type": "function", "function": _custom_as_function(tool)})
        else:
            functions.append({"type": "function", "function": _function(tool)})
        if namespace is not None:
            namespaces[tool["name"]] = namespace

    for i, tool in enumerate(given):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise fields.bad(where, f"'{where}' must be an object")
        if tool.get("type") in ("function", "custom"):
            add(tool, where, None)
            served.append(tool)
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for j, inner in enumerate(tool["tools"]):
                if isinstance(inner, dict) and inner.get("type") in ("function", "custom"):
                    add(inner, f"{where}.tools[{j}]", tool.get("name"))
            served.append(tool)
    return functions, served, custom, namespaces


def _choose_tools(body: dict, functions: list[dict]) -> tuple[list[dict] | None, bool, str | None]:
    """The tools the model may call under `tool_choice`, whether it must call one ('required', a function or
    custom tool choice, allowed_tools in mode 'required'), and the tool it must call when one is named."""
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", "required", None):
        return functions or None, choice == "required", None
    if choice == "none":
        return None, False, None
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and \
            choice.get("mode", "auto") in ("auto", "required"):
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        return [f for f in functions if f["function"]["name"] in allowed] or None, choice.get("mode") == "required", \
            None
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        if not isinstance(choice.get("name"), str):
            raise fields.bad("tool_choice", f"a {choice['type']} 'tool_choice' needs the tool's 'name'")
        return functions or None, True, choice["name"]
    raise fields.bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required', a function or custom tool, "
                     "or an allowed_tools choice; hosted tools are not served here")


# -- the request ----------------------------------------------------------------------------
def _refuse_state(body: dict) -> None:
    """Fields that need responses kept on the server: refused, since answering without them is wrong."""
    if body.get("store") is True:
        raise fields.bad("store", "'store': true is not supported: this server is stateless and keeps no "
                         "responses; send 'store': false and the whole conversation in 'input'")
    for name in ("previous_response_id", "conversation", "prompt"):
        if body.get(name) is not None:
            raise fields.bad(name, f"'{name}' is not supported: this server is stateless and keeps no responses, "
                             "conversations or prompts; send the whole conversation in 'input'")
    if fields.boolean(body, "background"):
        raise fields.bad("background", "'background': true is not supported: responses are not stored here")


def _template_options(state: ServerState, body: dict, constrained: bool) -> tuple[dict, dict | None]:
    """Template variables (the `chat_template_kwargs` extension, and the thinking switch from
    `reasoning.effort`), and the reasoning settings to echo. Structured output turns thinking off:
    the grammar allows the JSON only, so a thinking span could not be written."""
    options = body.get("chat_template_kwargs") or {}
    if not isinstance(options, dict) or set(options) & RESERVED_TEMPLATE_ARGS:
        raise fields.bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables "
                         f"(not {', '.join(sorted(RESERVED_TEMPLATE_ARGS))})")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise fields.bad("reasoning", "'reasoning' must be an object")
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise fields.bad("reasoning.effort", "'reasoning.effort' must be a string")
    thinking = getattr(state.tokenizer, "has_thinking", False) or "enable_thinking" in str(
        getattr(state.tokenizer, "chat_template", None) or "")
    if thinking and "enable_thinking" not in options and (effort is not None or constrained):
        options = dict(options, enable_thinking=not constrained and effort not in NO_THINKING)
    echo = None if reasoning is None else {"effort": effort, "summary": reasoning.get("summary")}
    return dict(options), echo


def _structured(state: ServerState, body: dict) -> tuple[Any, dict]:
    """The decoding constraint for `text.format` (None for plain text), and the text settings to echo."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise fields.bad("text", "'text' must be an object")
    shape = text.get("format")
    kind, schema = format_kind(shape, "text.format")
    echo = {"format": shape or {"type": "text"}, **({"verbosity": text["verbosity"]} if "verbosity" in text else {})}
    return constraint_for(state, kind, schema, "text.format"), echo


def responses_request(state: ServerState, body: dict) -> tuple[GenerationRequest, Options]:
    state.check_model(fields.string(body, "model"))
    _refuse_state(body)
    stream = fields.boolean(body, "stream")
    functions, served, custom, namespaces = parse_tools(body)
    tools, forced, name = _choose_tools(body, functions)
    messages, reasonings = conversation(body)
    chat = template_messages(messages)  # one entry per message, in order
    for entry, thought in zip(chat, reasonings, strict=True):
        if thought and entry["role"] == "assistant":
            entry["reasoning_content"] = thought  # how chat templates (Qwen3 and others) take earlier thinking
    constraint, text = _structured(state, body)
    if forced:  # the reply is the call(s) alone: the call grammar replaces any text format
        constraint = tool_choice_constraint(state, tools, name, "tool_choice",
                                            fields.boolean(body, "parallel_tool_calls", True))
    options, reasoning = _template_options(state, body, constraint is not None)
    prompt = state.render(chat, tools, options)
    max_output = fields.integer(body, "max_output_tokens", None, low=1)
    request = _sampling(state, body, prompt, max_output, "input")
    request.constraint = constraint
    echo = {
        "instructions": body.get("instructions"), "max_output_tokens": max_output,
        "parallel_tool_calls": fields.boolean(body, "parallel_tool_calls", True), "reasoning": reasoning,
        "temperature": request.temperature, "top_p": request.top_p, "text": text,
        "tool_choice": body.get("tool_choice") or "auto", "tools": served,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "prompt_cache_key": body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None,
    }
    return request, Options(stream, tools, custom, namespaces, constraint is not None and not forced, echo, forced)


# -- output ---------------------------------------------------------------------------------
def _parser(state: ServerState, request: GenerationRequest, options: Options) -> ReplyParser | PlainReply:
    if options.constrained:  # the reply is the JSON itself: no thinking span or tool markup to find in it
        return PlainReply()
    if options.forced:
        return forced_call_parser(state, options.tools, "call_")
    return reply_parser(state, request.prompt, options.tools, "call_")


def _usage(request: GenerationRequest, finished: Finished, reasoning_tokens: int) -> dict:
    prompt, completion, cached = usage_numbers(request, finished)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
            "total_tokens": prompt + completion}


class OutputBuilder:
    """Builds a response's output items from the parser's events, and the stream events that announce them.

    An item is open while its kind of output continues: reasoning, then a message, function calls
    (each complete when the parser yields it). Whitespace between items shows nowhere: it opens no
    message unless text follows it.
    """

    def __init__(self, state: ServerState, request: GenerationRequest, options: Options):
        self.state, self.request, self.options = state, request, options
        self.parser = _parser(state, request, options)
        self.response = dict(
            id=new_id("resp_"), object="response", created_at=int(time.time()), status="in_progress",
            background=False, error=None, incomplete_details=None, model=state.model_id, output=[],
            previous_response_id=None, store=False, truncation="disabled", usage=None, user=None,
            tools=[], tool_choice="auto", parallel_tool_calls=True)
        self.response.update(options.echo)
        self.sequence = 0
        self.current: dict | None = None  # the open message or reasoning item
        self.blank = ""  # whitespace text between items, shown only if text follows
        self.reasoning_tokens = 0
        self.reasoning = False  # the last output was reasoning

    def event(self, kind: str, **data: Any) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(data)}
        self.sequence += 1
        return out

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def step(self, step: Step) -> list[dict]:
        parts = self.parser.feed(step.text) if step.text else []
        if parts:
            self.reasoning = all(isinstance(p, ReasoningDelta) for p in parts)
        if self.reasoning:  # tokens of steps that added reasoning only (a cycle's tokens are not split)
            self.reasoning_tokens += len(step.tokens)
        return self._parts(parts)

    def _parts(self, parts: list) -> list[dict]:
        events: list[dict] = []
        for part in parts:
            if isinstance(part, TextDelta):
                events += self._text(part.text)
            elif isinstance(part, ReasoningDelta):
                events += self._reasoning(part.text)
            elif isinstance(part, ToolCallItem):
                events += self._call(part)
        return events

    # items --------------------------------------------------------------------------------
    def _open(self, item: dict) -> list[dict]:
        self.response["output"].append(item)
        return [self.event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                           item=item)]

    def _where(self, item: dict) -> dict:
        """Where an item's events point; the item being built is always the last one so far."""
        return {"item_id": item["id"], "output_index": len(self.response["output"]) - 1}

    def _text(self, text: str) -> list[dict]:
        events: list[dict] = []
        if self.current is None or self.current["type"] != "message":
            if not (self.blank + text).strip():
                self.blank += text
                return []
            text, self.blank = self.blank + text, ""
            events += self._close()
            events += self._open_message()
        part = self.current["content"][0]
        part["text"] += text
        events.append(self.event("response.output_text.delta", **self._where(self.current), content_index=0, delta=text,
                                 logprobs=[]))
        return events

    def _open_message(self) -> list[dict]:
        self.current = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
        events = self._open(self.current)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.current["content"].append(part)
        events.append(self.event("response.content_part.added", **self._where(self.current), content_index=0,
                                 part=part))
        return events

    def _reasoning(self, text: str) -> list[dict]:
        events: list[dict] = []
        if not text:
            return events
        if self.current is None or self.current["type"] != "reasoning":
            events += self._close()
            self.blank = ""
            self.current = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                            "status": "in_progress"}
            events += self._open(self.current)
            part = {"type": "reasoning_text", "text": ""}
            self.current["content"].append(part)
            events.append(self.event("response.content_part.added", **self._where(self.current), content_index=0,
                                     part=part))
        self.current["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", **self._where(self.current), content_index=0,
                                 delta=text))
        return events

    def _call(self, call: ToolCallItem) -> list[dict]:
        events = self._close()
        self.blank = ""
        custom = call.name in self.options.custom
        item_id = new_id("ctc_" if custom else "fc_")
        if custom:
            value = call.arguments.get(CUSTOM_INPUT)
            text = value if isinstance(value, str) else call.arguments_json
            item = {"id": item_id, "type": "custom_tool_call", "call_id": call.id, "name": call.name, "input": ""}
        else:
            text = call.arguments_json
            item = {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name, "arguments": "",
                    "status": "in_progress"}
        if call.name in self.options.namespaces:
            item["namespace"] = self.options.namespaces[call.name]
        events += self._open(item)
        where = self._where(item)
        if custom:
            item["input"] = text
            events.append(self.event("response.custom_tool_call_input.delta", **where, delta=text))
            events.append(self.event("response.custom_tool_call_input.done", **where, input=text))
        else:
            item["arguments"], item["status"] = text, "completed"
            events.append(self.event("response.function_call_arguments.delta", **where, delta=text))
            events.append(self.event("response.function_call_arguments.done", **where, arguments=text))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.current = self.current, None
        if item is None:
            return []
        where = self._where(item)
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            done = [self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])]
        else:
            done = [self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])]
        done.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        done.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return done

    # the end ------------------------------------------------------------------------------
    def finish(self, finished: Finished) -> list[dict]:
        """The last items and the closing event: response.completed, .incomplete (cut by max_output_tokens)
        or .failed."""
        if finished.finish_reason == "error":
            events = self._close("incomplete")
            self.response.update(status="failed", error={"code": "server_error",
                                                         "message": f"generation failed: {finished.error}"})
            return events + [self.event("response.failed", response=self.response)]
        events = self._parts(self.parser.finish())
        if not self.response["output"] and self.current is None:  # an empty (or blank) reply is still a message
            events += self._open_message()
            blank, self.blank = self.blank, ""
            if blank:
                events += self._text(blank)
        cut = finished.finish_reason == "length"
        events += self._close("incomplete" if cut else "completed")
        status = {"length": "incomplete", "cancelled": "cancelled"}.get(finished.finish_reason, "completed")
        self.response.update(status=status, usage=_usage(self.request, finished, self.reasoning_tokens),
                             dflash=dflash_extension(self.state, finished))
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return events + [self.event(kind, response=self.response)]


def reply(state: ServerState, request: GenerationRequest, options: Options, steps: list[Step],
          finished: Finished) -> dict:
    if finished.finish_reason == "error":
        raise APIError(500, f"generation failed: {finished.error}")
    out = OutputBuilder(state, request, options)
    for step in steps:
        out.step(step)
    out.finish(finished)
    return out.response


async def stream(
    state: ServerState, request: GenerationRequest, options: Options, job: JobStream
) -> AsyncIterator[str]:
    out = OutputBuilder(state, request, options)
    for event in out.start():
        yield sse_event(event, event["type"])
    async for item in job:
        events = out.step(item) if isinstance(item, Step) else out.finish(item)
        for event in events:
            yield sse_event(event, event["type"])
