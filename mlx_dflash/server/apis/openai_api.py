"""OpenAI chat/completions and completions: request validation, replies and SSE chunk shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..http import fields
from ..http.errors import failure
from ..http.sse import done_event, sse_event
from ..http.state import JobStream, ServerState, dflash_extension, usage_numbers
from ..reply.events import ReasoningDelta, TextDelta, ToolCallItem
from ..reply.parser import ReplyParser
from ..reply.structured import constraint_for, format_kind, output_parser, tool_choice_constraint, without_thinking
from ..reply.tools import template_tool_call
from ..worker.jobs import Finished, GenerationRequest, Step, TokenLogprob

ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's logprob for a token that cannot occur: a grammar (structured output, a forced call) masks
# tokens to -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0
# Arguments of apply_chat_template itself, not template variables.
RESERVED_TEMPLATE_ARGS = {"tokenize", "add_generation_prompt", "return_dict", "tools", "conversation",
                          "continue_final_message", "padding", "truncation", "max_length", "return_tensors"}


@dataclass
class Options:
    """What shapes the reply, beyond what the engine generates."""

    kind: str  # "chat" | "completion"
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    parser: ReplyParser | None = None  # chat: splits the reply into content, reasoning and tool calls


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise fields.bad(where, f"'{where}' parts must be text parts ({{'type': 'text', 'text': ...}}); "
                                 "this server serves a text model")
            parts.append(part["text"])
        return "".join(parts)
    raise fields.bad(where, f"'{where}' must be a string or an array of text parts")


def template_messages(messages: list) -> list[dict]:
    """OpenAI messages as chat templates take them (content as text, earlier tool calls as mappings)."""
    if not messages:
        raise fields.bad("messages", "'messages' must hold at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise fields.bad(where, f"'{where}' must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise fields.bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _text_content(message.get("content"), f"{where}.content")}
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise fields.bad(f"{where}.tool_calls", f"'{where}.tool_calls' must be an array")
            try:
                entry["tool_calls"] = [template_tool_call(c["function"]["name"], c["function"].get("arguments", {}))
                                       for c in calls]
            except (KeyError, TypeError, AttributeError):
                raise fields.bad(f"{where}.tool_calls", "each tool call needs function.name") from None
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        out.append(entry)
    return out


def parse_tools(body: dict) -> list[dict] | None:
    tools = fields.array(body, "tools")
    if not tools:
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise fields.bad(f"tools[{i}]", f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ...}}}}")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None
    if choice not in ("auto", "required") and not (isinstance(choice, dict) and choice.get("type") == "function"):
        raise fields.bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a function choice")
    return tools


def forced_tool(body: dict) -> tuple[bool, str | None]:
    """Whether `tool_choice` forces a call ('required' or a function choice), and the function it names."""
    choice = body.get("tool_choice", "auto")
    if not isinstance(choice, dict):
        return choice == "required", None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise fields.bad("tool_choice", "a function 'tool_choice' needs function.name: "
                         "{'type': 'function', 'function': {'name': ...}}")
    return True, name


def sampling_request(state: ServerState, body: dict, prompt: list[int], max_tokens: int | None,
                     param: str = "messages") -> GenerationRequest:
    """The generation request for `prompt` with the body's sampling fields (shared with Responses)."""
    if fields.integer(body, "n", 1) != 1:
        raise fields.bad("n", "'n' must be 1: this server returns one choice per request")
    return GenerationRequest(
        prompt=prompt,
        max_tokens=state.budget(prompt, max_tokens, param),
        temperature=fields.temperature(body, "temperature", state.temperature_default, 2.0),
        top_p=fields.top_p(body, "top_p"),
        top_k=fields.top_k(body, "top_k", state.engine.target.vocab_size),
        min_p=fields.number(body, "min_p", 0.0, 0.0, 1.0),
        seed=fields.seed(body),
        stops=fields.stop_strings(body, "stop"),
    )


def _common(state: ServerState, body: dict) -> None:
    fields.unicode_text(body)
    state.check_model(fields.string(body, "model"))
    fields.boolean(body, "stream")


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise fields.bad("stream_options", "'stream_options' must be an object")
    if not stream:
        raise fields.bad("stream_options", "'stream_options' is only allowed with 'stream': true")
    return fields.boolean(options, "include_usage")


def chat_request(state: ServerState, body: dict) -> tuple[GenerationRequest, Options]:
    _common(state, body)
    messages = template_messages(fields.array(body, "messages", required=True))
    tools = parse_tools(body)
    forced, name = forced_tool(body)
    options = body.get("chat_template_kwargs") or {}
    if not isinstance(options, dict) or set(options) & RESERVED_TEMPLATE_ARGS:
        raise fields.bad("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables "
                         f"(not {', '.join(sorted(RESERVED_TEMPLATE_ARGS))})")
    constraint = constraint_for(state, *format_kind(body.get("response_format"), "response_format"),
                                "response_format")
    if forced:
        # The reply is the call(s) alone: no text for a response format to shape, so the call grammar replaces it.
        constraint = tool_choice_constraint(state, tools, name, "tool_choice",
                                            fields.boolean(body, "parallel_tool_calls", True))
    if constraint is not None:
        options = without_thinking(options)
    prompt = state.render(messages, tools, options)
    max_tokens = fields.integer(body, "max_completion_tokens", fields.integer(body, "max_tokens", None, low=1), low=1)
    request = sampling_request(state, body, prompt, max_tokens)
    logprobs = fields.boolean(body, "logprobs")
    top = fields.integer(body, "top_logprobs", None, 0, 20)
    if top is not None and not logprobs:
        raise fields.bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    request.top_logprobs = (top or 0) if logprobs else None
    request.constraint = constraint
    stream = fields.boolean(body, "stream")
    parser = output_parser(state, prompt, tools, "call_", forced=forced, constrained=constraint is not None)
    return request, Options("chat", stream, _stream_options(body, stream), logprobs, parser)


def completion_request(state: ServerState, body: dict) -> tuple[GenerationRequest, Options]:
    _common(state, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = state.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = state.engine.target.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise fields.bad("prompt", f"token ids must be in [0, {vocab})")
        ids = list(prompt)
    else:
        raise fields.bad("prompt", "'prompt' must be a string, an array of token ids, or an array of one of these")
    for name, default in (("echo", False), ("suffix", None)):
        if body.get(name) not in (None, default):
            raise fields.bad(name, f"'{name}' is not supported by this server")
    if fields.integer(body, "best_of", 1) != 1:
        raise fields.bad("best_of", "'best_of' must be 1")
    request = sampling_request(state, body, ids, fields.integer(body, "max_tokens", None, low=1), "prompt")
    request.top_logprobs = fields.integer(body, "logprobs", None, 0, 20)
    stream = fields.boolean(body, "stream")
    return request, Options("completion", stream, _stream_options(body, stream), request.top_logprobs is not None)


# -- replies --------------------------------------------------------------------------------
def _finish_reason(finished: Finished, tool_calls: bool) -> str:
    error = failure(finished.finish_reason, finished.error)
    if error is not None:
        raise error
    if tool_calls:
        return "tool_calls"
    return "length" if finished.finish_reason == "length" else "stop"


def _usage(state: ServerState, request: GenerationRequest, finished: Finished) -> dict:
    prompt, completion, cached = usage_numbers(request, finished)
    accepted = sum(finished.stats.accepted_by_source.values())
    rejected = sum(finished.stats.proposed_by_source.values()) - accepted
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            # Tokens proposed (drafted or looked up) that verification kept or discarded.
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def _logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN) too


class _LogprobFormat:
    def __init__(self, state: ServerState):
        self.decode = state.tokenizer.decode
        self.offset = 0

    def chat(self, items: list[TokenLogprob]) -> list[dict]:
        def one(token: int, logprob: float) -> dict:
            text = self.decode([token])
            return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

        return [dict(one(i.token, i.logprob), top_logprobs=[one(t, lp) for t, lp in i.top]) for i in items]

    def completion(self, items: list[TokenLogprob]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for item in items:
            text = self.decode([item.token])
            out["tokens"].append(text)
            out["token_logprobs"].append(_logprob(item.logprob))
            out["top_logprobs"].append({self.decode([t]): _logprob(lp) for t, lp in item.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _tool_call(call: ToolCallItem) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


def _deltas(events: list, parser: ReplyParser) -> list[dict]:
    """Chat chunk deltas of parser events; a call's index is its place among the reply's calls."""
    deltas = []
    for event in events:
        if isinstance(event, TextDelta):
            deltas.append({"content": event.text})
        elif isinstance(event, ReasoningDelta):
            deltas.append({"reasoning_content": event.text})
        else:
            index = next(i for i, c in enumerate(parser.calls) if c is event)
            deltas.append({"tool_calls": [dict(_tool_call(event), index=index)]})
    return deltas


def reply(state: ServerState, request: GenerationRequest, options: Options, steps: list[Step],
          finished: Finished) -> dict:
    text = "".join(s.text for s in steps)
    logprob_items = [lp for s in steps for lp in (s.logprobs or [])]
    fmt = _LogprobFormat(state)
    created = int(time.time())
    if options.kind == "completion":
        reason = _finish_reason(finished, False)
        choice = {"index": 0, "text": text, "logprobs": fmt.completion(logprob_items) if options.logprobs else None,
                  "finish_reason": reason}
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": created,
                "model": state.model_id, "choices": [choice], "usage": _usage(state, request, finished),
                "system_fingerprint": None, "dflash": dflash_extension(state, finished)}
    parser = options.parser
    events = [e for s in steps for e in parser.feed(s.text)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [_tool_call(c) for c in parser.calls]
    reason = _finish_reason(finished, bool(calls))
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message,
              "logprobs": {"content": fmt.chat(logprob_items), "refusal": None} if options.logprobs else None,
              "finish_reason": reason}
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": created,
            "model": state.model_id, "choices": [choice], "usage": _usage(state, request, finished),
            "system_fingerprint": None, "dflash": dflash_extension(state, finished)}


async def stream(
    state: ServerState, request: GenerationRequest, options: Options, job: JobStream
) -> AsyncIterator[str]:
    chat = options.kind == "chat"
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": state.model_id, "system_fingerprint": None}
    fmt = _LogprobFormat(state)

    def chunk(text: str | None = None, reason: str | None = None, logprobs: list | None = None,
              delta: dict | None = None) -> dict:
        if chat:
            choice = {"index": 0, "delta": delta if delta is not None else {"content": text},
                      "logprobs": {"content": fmt.chat(logprobs), "refusal": None} if logprobs is not None else None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason,
                      "logprobs": fmt.completion(logprobs) if logprobs is not None else None}
        out = dict(base, choices=[choice])
        if options.include_usage:
            out["usage"] = None
        return out

    parser = options.parser
    if chat:
        yield sse_event(chunk(delta={"role": "assistant", "content": ""}))
    async for item in job:
        if isinstance(item, Step):
            logprobs = item.logprobs if options.logprobs else None
            if not chat:
                if item.text or logprobs:
                    yield sse_event(chunk(item.text, logprobs=logprobs))
                continue
            deltas = _deltas(parser.feed(item.text), parser)
            if logprobs and not deltas:  # the tokens' text is held back (or markup): their logprobs still go out
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                yield sse_event(chunk(delta=delta, logprobs=logprobs if i == 0 else None))
            continue
        error = failure(item.finish_reason, item.error)
        if error is not None:
            yield sse_event(error.openai_body())
            break
        if chat:
            for delta in _deltas(parser.finish(), parser):
                yield sse_event(chunk(delta=delta))
        last = chunk(reason=_finish_reason(item, bool(parser and parser.calls)), delta={} if chat else None)
        last["dflash"] = dflash_extension(state, item)
        yield sse_event(last)
        if options.include_usage:
            yield sse_event(dict(base, choices=[], usage=_usage(state, request, item)))
    yield done_event()
