"""OpenAI Responses (`POST /v1/responses`), the output side: output items and the streaming event sequence.

`OutputBuilder` turns the per-request `ReplyParser`'s events (reply/parser.py) into reasoning, message,
function-call and custom-tool-call output items, and into the `response.*` stream events that
announce them; `reply` builds the whole response object for a non-streamed request, `stream` the
server-sent events. `Options` (what shapes the output beyond what the engine generates) is defined
here and filled in by the request side (responses_api.py), which imports this module and
re-exports its names; this module does not import the request side, so there is no cycle.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..http.errors import failure
from ..http.sse import sse_event
from ..http.state import JobStream, ServerState, dflash_extension, usage_numbers
from ..reply.events import ReasoningDelta, TextDelta, ToolCallItem
from ..reply.parser import ReplyParser
from ..reply.structured import PlainReply, output_parser
from ..worker.jobs import Finished, GenerationRequest, Step

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


def _parser(state: ServerState, request: GenerationRequest, options: Options) -> ReplyParser | PlainReply:
    return output_parser(state, request.prompt, options.tools, "call_", forced=options.forced,
                         constrained=options.constrained)


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
        or .failed (the generation failed: status failed; the server cancelled it: status cancelled), whose
        `error` says why (its code is `server_error` either way: the Responses error codes are a fixed set)."""
        error = failure(finished.finish_reason, finished.error)
        if error is not None:
            events = self._close("incomplete")
            self.response.update(status="failed" if finished.finish_reason == "error" else "cancelled",
                                 error={"code": "server_error", "message": error.message})
            return events + [self.event("response.failed", response=self.response)]
        events = self._parts(self.parser.finish())
        if not self.response["output"] and self.current is None:  # an empty (or blank) reply is still a message
            events += self._open_message()
            blank, self.blank = self.blank, ""
            if blank:
                events += self._text(blank)
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        events += self._close(status)
        self.response.update(status=status, usage=_usage(self.request, finished, self.reasoning_tokens),
                             dflash=dflash_extension(self.state, finished))
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.response["completed_at"] = int(time.time())
        return events + [self.event(f"response.{status}", response=self.response)]


def reply(state: ServerState, request: GenerationRequest, options: Options, steps: list[Step],
          finished: Finished) -> dict:
    error = failure(finished.finish_reason, finished.error)
    if error is not None:
        raise error
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
