"""Anthropic Messages: request validation, replies and the streaming event sequence."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from . import fields
from .engine import Finished, GenerationRequest, Step
from .errors import APIError
from .sse import sse_event
from .state import JobStream, ServerState, dflash_extension, usage_numbers
from .tools import TOOL_CALL_OPEN, parse_tool_calls, template_tool_call


@dataclass
class Options:
    stream: bool = False
    tools: bool = False


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise fields.bad(where, f"'{where}' must be a string or an array of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in ("text", "tool_use", "tool_result"):
            raise fields.bad(f"{where}[{i}]", f"'{where}[{i}]' must be a text, tool_use or tool_result block; "
                             "this server serves a text model")
    return content


def _block_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    texts = []
    for block in _blocks(content, where):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise fields.bad(where, f"'{where}' may hold only text blocks here")
        texts.append(block["text"])
    return "".join(texts)


def template_messages(body: dict) -> list[dict]:
    messages = fields.array(body, "messages", required=True)
    if not messages:
        raise fields.bad("messages", "'messages' must hold at least one message")
    system = body.get("system")
    out = [{"role": "system", "content": _block_text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise fields.bad(f"{where}.role", f"'{where}.role' must be 'user' or 'assistant'")
        text, calls = [], []
        for block in _blocks(message.get("content"), f"{where}.content"):
            if block["type"] == "text":
                text.append(str(block.get("text", "")))
            elif block["type"] == "tool_use" and message["role"] == "assistant":
                if not isinstance(block.get("name"), str):
                    raise fields.bad(f"{where}.content", "a tool_use block needs a name")
                calls.append(template_tool_call(block["name"], block.get("input", {})))
            elif block["type"] == "tool_result" and message["role"] == "user":
                result = block.get("content")
                result_text = result if isinstance(result, str) else _block_text(result, f"{where}.content")
                out.append({"role": "tool", "content": result_text, "tool_call_id": block.get("tool_use_id")})
            else:
                raise fields.bad(f"{where}.content", f"a {block['type']} block cannot appear in a "
                                 f"{message['role']} message")
        if text or calls or not message.get("content"):
            entry: dict[str, Any] = {"role": message["role"], "content": "".join(text)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def template_tools(body: dict) -> list[dict] | None:
    tools = fields.array(body, "tools")
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise fields.bad(f"tools.{i}", f"'tools.{i}' needs a name")
        converted.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {"type": "object"})}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "none":
        return None
    return converted


def _prompt(state: ServerState, body: dict) -> tuple[list[int], bool]:
    state.check_model(fields.string(body, "model"))
    tools = template_tools(body)
    return state.render(template_messages(body), tools), bool(tools)


def count_request(state: ServerState, body: dict) -> list[int]:
    return _prompt(state, body)[0]


def messages_request(state: ServerState, body: dict) -> tuple[GenerationRequest, Options]:
    max_tokens = fields.integer(body, "max_tokens", None, low=1)
    if max_tokens is None:
        raise APIError(400, "'max_tokens' is required", param="max_tokens")
    prompt, tools = _prompt(state, body)
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=state.budget(prompt, max_tokens),
        temperature=fields.number(body, "temperature", state.temperature_default, 0.0, 1.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=fields.integer(body, "top_k", 0, low=0),
        stops=fields.stop_strings(body, "stop_sequences", limit=64),
        capture_marker=TOOL_CALL_OPEN if tools else None,
    )
    return request, Options(fields.boolean(body, "stream"), tools)


# -- replies --------------------------------------------------------------------------------
def _tool_blocks(finished: Finished, tools: bool) -> tuple[list[dict], str]:
    if not tools or finished.captured is None:
        return [], ""
    calls = parse_tool_calls(finished.captured, prefix="toolu_")
    if calls is None:
        return [], TOOL_CALL_OPEN + finished.captured
    return [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls], ""


def _stop_reason(finished: Finished, tool_use: bool) -> str:
    if finished.finish_reason == "error":
        raise APIError(500, f"generation failed: {finished.error}")
    if tool_use:
        return "tool_use"
    if finished.stop is not None:
        return "stop_sequence"
    return "max_tokens" if finished.finish_reason == "length" else "end_turn"


def _usage(request: GenerationRequest, finished: Finished) -> dict:
    prompt, completion, cached = usage_numbers(request, finished)
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def reply(state: ServerState, request: GenerationRequest, options: Options, steps: list[Step],
          finished: Finished) -> dict:
    blocks, leftover = _tool_blocks(finished, options.tools)
    text = "".join(s.text for s in steps) + leftover
    content = ([{"type": "text", "text": text}] if text or not blocks else []) + blocks
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": state.model_id,
            "content": content, "stop_reason": _stop_reason(finished, bool(blocks)),
            "stop_sequence": finished.stop, "usage": _usage(request, finished),
            "dflash": dflash_extension(state, finished)}


async def stream(
    state: ServerState, request: GenerationRequest, options: Options, job: JobStream
) -> AsyncIterator[str]:
    def event(data: dict) -> str:
        return sse_event(data, data["type"])

    message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": state.model_id,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": len(request.prompt), "output_tokens": 0}}
    yield event({"type": "message_start", "message": message})
    index, text_open = 0, False
    async for item in job:
        if isinstance(item, Step):
            if item.text:
                if not text_open:
                    yield event({"type": "content_block_start", "index": index,
                                 "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield event({"type": "content_block_delta", "index": index,
                             "delta": {"type": "text_delta", "text": item.text}})
            continue
        if item.finish_reason == "error":
            yield event(APIError(500, f"generation failed: {item.error}").anthropic_body())
            return
        blocks, leftover = _tool_blocks(item, options.tools)
        if leftover or not (text_open or blocks):
            if not text_open:
                yield event({"type": "content_block_start", "index": index,
                             "content_block": {"type": "text", "text": ""}})
                text_open = True
            if leftover:
                yield event({"type": "content_block_delta", "index": index,
                             "delta": {"type": "text_delta", "text": leftover}})
        if text_open:
            yield event({"type": "content_block_stop", "index": index})
            index += 1
        for block in blocks:
            yield event({"type": "content_block_start", "index": index, "content_block": dict(block, input={})})
            yield event({"type": "content_block_delta", "index": index,
                         "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            yield event({"type": "content_block_stop", "index": index})
            index += 1
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": _stop_reason(item, bool(blocks)), "stop_sequence": item.stop},
                     "usage": _usage(request, item), "dflash": dflash_extension(state, item)})
        yield event({"type": "message_stop"})
