"""OpenAI Responses (`POST /v1/responses`), the request side: validation and the generation request.

The server is stateless: every request carries the whole conversation (`input` items), as Codex
sends it with `store: false`. Input items become chat messages, which the chat template renders
as chat completions would (earlier reasoning items become the next assistant turn's
`reasoning_content`); the reply's text is split into reasoning, message and function-call output
items by the per-request `ReplyParser` (reply/parser.py). Fields a local model cannot honour (`include`,
`prompt_cache_key`, `metadata`, ...) are accepted and ignored; what would silently change the
answer (`store: true`, `previous_response_id`) is refused with a 400 that says why. A forced tool call
(`tool_choice` 'required', a named tool, allowed_tools in mode 'required') is decoded under a grammar of
the model's call markup (reply/structured.py), or refused with a 400 where the model's call format has none.

Tools: function tools are served; namespace tools are flattened into their function tools (calls
carry the namespace back); hosted tools the model cannot run here (web_search, local_shell, mcp, ...)
are left out. A custom (freeform) tool, such as Codex's apply_patch, is offered to the model as a
function with one string argument `input` (its grammar, if any, told in that argument's description,
not enforced), and a call to it comes back as a `custom_tool_call` item with that string as its input.
The output items and stream events are built in responses_output.py, whose names (`OutputBuilder`,
`reply`, `stream`, `Options`) are re-exported here, so this module stays the route's API module.
"""

from __future__ import annotations

import json
from typing import Any

from ..http import fields
from ..http.errors import APIError
from ..http.state import ServerState
from ..reply.structured import constraint_for, format_kind, tool_choice_constraint
from ..worker.jobs import GenerationRequest
from .openai_api import RESERVED_TEMPLATE_ARGS, sampling_request, template_messages
from .responses_output import CUSTOM_INPUT, Options
from .responses_output import OutputBuilder as OutputBuilder  # re-exported: app.py and the tests reach them here
from .responses_output import new_id as new_id
from .responses_output import reply as reply
from .responses_output import stream as stream

INPUT_ROLES = ("system", "developer", "user", "assistant")
# Reasoning efforts that mean "do not think" for a template with a thinking switch.
NO_THINKING = ("none", "minimal")


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
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(choice, functions)
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        if not isinstance(choice.get("name"), str):
            raise fields.bad("tool_choice", f"a {choice['type']} 'tool_choice' needs the tool's 'name'")
        return functions or None, True, choice["name"]
    raise fields.bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required', a function or custom tool, "
                     "or an allowed_tools choice; hosted tools are not served here")


def _allowed_tools(choice: dict, functions: list[dict]) -> tuple[list[dict] | None, bool, None]:
    """`_choose_tools` for an allowed_tools choice: the offered tools it lists by name (hosted tools it
    lists have none here), in mode 'auto' or 'required'."""
    mode = choice.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise fields.bad("tool_choice.mode", "'tool_choice.mode' of an allowed_tools choice must be 'auto' or "
                         "'required'")
    listed = choice.get("tools")
    listed = [] if listed is None else listed
    if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
        raise fields.bad("tool_choice.tools", "'tool_choice.tools' must be an array of tools, such as "
                         "{'type': 'function', 'name': ...}")
    allowed = {t["name"] for t in listed if isinstance(t.get("name"), str)}
    return [f for f in functions if f["function"]["name"] in allowed] or None, mode == "required", None


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
    fields.unicode_text(body)
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
    request = sampling_request(state, body, prompt, max_output, "input")
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
