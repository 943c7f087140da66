"""`dflash-mlx serve`, OpenAI Responses (`POST /v1/responses`) over a live server, with the official SDK.

Plain replies are checked against the target decoding alone and against chat completions; tool
calls and reasoning use a scripted target (a tiny real model made to emit fixed strings), and a
request shaped like Codex's is served and its event stream validated against the SDK's types.
"""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from helpers.scripted import QWEN_LIKE_TURNS, scripted_pair
from helpers.serverkit import MODEL_ID, LiveServer, cancelled_by_the_server, endless_pair, openai_client, tiny_pair
from helpers.tiny import EOS_ID, greedy_reference
from openai.types.responses import ResponseStreamEvent

from mlx_dflash.decoding.stats import GenerationStats
from mlx_dflash.server.apis.responses_api import Options, OutputBuilder
from mlx_dflash.server.worker.jobs import Finished, GenerationRequest, Step

THOUGHT_TEXT = "The user asks about Paris."
THOUGHT = THOUGHT_TEXT + "\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PATCH_TEXT = "*** Begin Patch\n*** End Patch"
PATCH = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** End Patch"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
# A Qwen3-like template: tools, earlier thinking (reasoning_content) and calls, tool results, and a
# generation prompt that ends with the last message's last character (what the scripted target reads),
# opening a thinking span when enable_thinking is on.
TEMPLATE = QWEN_LIKE_TURNS + (
    "{%- if add_generation_prompt %}{% if messages[-1].role == 'tool' %}R={% else %}"
    "A{{ messages[-1].content[-1:] }}{% if enable_thinking %}<think>{% endif %}{% endif %}{% endif %}"
)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def client(pair):
    with LiveServer(*pair) as live:
        yield openai_client(live)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A scripted target (scripted.py): '?' -> a get_weather call, '!' -> an apply_patch call, '>' (a
    thinking span opened) -> a thought then the call, '=' -> an answer."""
    script = [("?", CALL), ("!", PATCH), (">", THOUGHT), (THOUGHT, CALL), ("=", ANSWER),
              (CALL, "</s>"), (PATCH, "</s>"), (ANSWER, "</s>")]
    pair = scripted_pair(tmp_path_factory.mktemp("scripted"), template=TEMPLATE,
                         strings=[CALL, PATCH, THOUGHT, ANSWER], script=script)
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def tools_client(scripted):
    return openai_client(scripted)


@pytest.fixture(scope="module")
def endless(pair):
    """The tiny target with its end-of-sequence row zeroed: greedy replies never stop on their own."""
    return endless_pair(pair[1])


def reference(pair, messages: list[dict], n: int) -> tuple[str, int]:
    """The target alone: greedy text and its length in tokens."""
    model, tokenizer, _ = pair
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    out = greedy_reference(model, prompt, n)
    out = out[: out.index(EOS_ID)] if EOS_ID in out else out
    return tokenizer.decode(out), len(out)


def plain(model) -> dict:
    """A model's fields, without the `parsed*` ones the SDK's stream helper adds."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not k.startswith("parsed")}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return strip(model.model_dump())


def check_events(events: list, final) -> None:
    """The Responses event grammar: created, in_progress, each output item opened, filled and closed in
    order (its deltas adding up to its final text), then one closing event carrying the final response."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    closing, given = events[-1], final
    assert closing.type == {"completed": "response.completed", "incomplete": "response.incomplete",
                            "failed": "response.failed", "cancelled": "response.failed"}[given.status]
    final = closing.response
    assert final.id == given.id and final.output_text == given.output_text and final.usage == given.usage
    assert [o.type for o in final.output] == [o.type for o in given.output]
    index, text, parts = -1, "", 0
    for event in events[2:-1]:
        kind = event.type
        if kind == "response.output_item.added":
            index, text, parts = index + 1, "", 0
            assert event.output_index == index
            continue
        assert event.output_index == index, kind
        item = final.output[index]
        if kind == "response.output_item.done":
            assert plain(event.item) == plain(item)
        elif kind == "response.content_part.added":
            parts += 1
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            assert event.item_id == item.id
            text += event.delta
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert event.text == text == item.content[0].text and parts == 1
        elif kind == "response.function_call_arguments.done":
            assert event.arguments == text == item.arguments
        elif kind == "response.custom_tool_call_input.done":
            assert event.input == text == item.input
        elif kind == "response.content_part.done":
            assert plain(event.part) == plain(item.content[0])
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert index == len(final.output) - 1


# -- plain text: the target's own greedy reply ------------------------------------------------
def test_greedy_equals_target_alone_and_chat_completions(pair, client):
    reply = client.responses.create(model=MODEL_ID, instructions="You are terse.", input="Explain caches.",
                                    max_output_tokens=40, store=False)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain caches."}]
    text, n = reference(pair, messages, 40)
    assert reply.object == "response" and reply.model == MODEL_ID and reply.id.startswith("resp_")
    assert reply.output_text == text
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert [p.type for p in message.content] == ["output_text"]
    assert reply.usage.output_tokens == n
    assert reply.usage.input_tokens == len(pair[1].apply_chat_template(messages, add_generation_prompt=True))
    assert reply.usage.total_tokens == reply.usage.input_tokens + n
    chat = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=40)
    assert chat.choices[0].message.content == reply.output_text
    assert reply.status == ("incomplete" if n == 40 else "completed")


def test_stream_events_and_sdk_accumulation(pair, client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Explain caches."}]}]
    with client.responses.stream(model=MODEL_ID, input=items, max_output_tokens=100) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_events(events, final)
    text, n = reference(pair, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Explain caches."}], 100)
    assert n < 100, "the tiny target must stop by itself here (the SDK's helper wants response.completed)"
    assert final.output_text == text and final.usage.output_tokens == n and final.status == "completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    raw = list(client.responses.create(model=MODEL_ID, input=items, max_output_tokens=100, stream=True))
    check_events(raw, raw[-1].response)  # the plain stream (no helper) parses as well
    assert raw[-1].response.output_text == text


def test_max_output_tokens_makes_the_response_incomplete(pair, client):
    _, n = reference(pair, [{"role": "user", "content": "Go on and on."}], 5)
    assert n == 5, "the tiny target must not stop within 5 tokens for this test"
    reply = client.responses.create(model=MODEL_ID, input="Go on and on.", max_output_tokens=5)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].status == "incomplete" and reply.usage.output_tokens == 5
    assert reply.max_output_tokens == 5
    events = list(client.responses.create(model=MODEL_ID, input="Go on and on.", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    check_events(events, events[-1].response)


# -- tools and reasoning on the scripted target -----------------------------------------------
def test_function_call_round_trip(tools_client):
    first = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER], max_output_tokens=16)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")

    with tools_client.responses.stream(model=MODEL_ID, input=QUESTION, tools=[WEATHER],
                                       max_output_tokens=16) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    check_events(events, streamed)
    assert [o.type for o in streamed.output] == ["function_call"]
    assert not [e for e in events if e.type == "response.output_text.delta"]  # no markup shown as text

    history = QUESTION + [o.model_dump(exclude_none=True) for o in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}]
    second = tools_client.responses.create(model=MODEL_ID, input=history, tools=[WEATHER], max_output_tokens=16)
    assert second.output_text == ANSWER and second.status == "completed"
    assert [o.type for o in second.output] == ["message"]

    plain = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER], tool_choice="none",
                                          max_output_tokens=16)
    assert plain.output_text == CALL  # no tools offered: the markup is just text


def test_namespaced_tools_and_allowed_tools(tools_client):
    namespace = {"type": "namespace", "name": "weather", "description": "Weather tools",
                 "tools": [dict(WEATHER, strict=False)]}
    reply = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[namespace], max_output_tokens=16)
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.namespace == "weather"
    assert reply.tools[0].type == "namespace"
    other = dict(WEATHER, name="get_time")
    allowed = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_time"}]}
    narrowed = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER, other],
                                             tool_choice=allowed, max_output_tokens=16)
    alone = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[other], max_output_tokens=16)
    assert narrowed.usage.input_tokens == alone.usage.input_tokens  # the template lists the allowed tools only
    both = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER, other], max_output_tokens=16)
    assert both.usage.input_tokens == narrowed.usage.input_tokens + len("get_weather;")


def test_reasoning_items_and_effort(tools_client):
    thinking = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER], max_output_tokens=16,
                                             reasoning={"effort": "high"})
    reasoning, call = thinking.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [THOUGHT_TEXT]
    assert reasoning.summary == [] and call.type == "function_call" and call.name == "get_weather"
    assert 0 < thinking.usage.output_tokens_details.reasoning_tokens <= thinking.usage.output_tokens
    none = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER], max_output_tokens=16,
                                         reasoning={"effort": "minimal"})
    assert [o.type for o in none.output] == ["function_call"]  # the thinking switch is off
    assert thinking.usage.input_tokens == none.usage.input_tokens + len("<think>")

    with tools_client.responses.stream(model=MODEL_ID, input=QUESTION, tools=[WEATHER], max_output_tokens=16,
                                       reasoning={"effort": "low"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    check_events(events, final)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT_TEXT

    # The reasoning item sent back reaches the template as the assistant turn's reasoning_content.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items = [o.model_dump(exclude_none=True) for o in thinking.output]
    with_thought = tools_client.responses.create(model=MODEL_ID, input=QUESTION + items + [result],
                                                 tools=[WEATHER], max_output_tokens=16)
    without = tools_client.responses.create(model=MODEL_ID, input=QUESTION + items[1:] + [result],
                                            tools=[WEATHER], max_output_tokens=16)
    assert with_thought.output_text == without.output_text == ANSWER
    assert with_thought.usage.input_tokens == without.usage.input_tokens + len(f"<think>{THOUGHT_TEXT}</think>")


def test_custom_tool_call_round_trip(tools_client):
    patch = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/'}}
    first = tools_client.responses.create(model=MODEL_ID, input="Fix it!", tools=[WEATHER, patch],
                                          max_output_tokens=16)
    (call,) = first.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH_TEXT
    with tools_client.responses.stream(model=MODEL_ID, input="Fix it!", tools=[patch], max_output_tokens=16) as s:
        events = list(s)
        final = s.get_final_response()
    check_events(events, final)
    assert [e.type for e in events if "custom_tool_call_input" in e.type] == [
        "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"]
    history = [{"role": "user", "content": "Fix it!"}, call.model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    second = tools_client.responses.create(model=MODEL_ID, input=history, tools=[patch], max_output_tokens=16)
    assert second.output_text == ANSWER


def codex_request() -> dict:
    """A request body shaped like Codex's (`codex exec`, wire_api "responses"), from the public docs."""
    def function(name: str, properties: dict, required: list[str]) -> dict:
        return {"type": "function", "name": name, "description": f"The {name} tool.", "strict": False,
                "parameters": {"type": "object", "properties": properties, "required": required,
                               "additionalProperties": False}}

    text = {"type": "string"}
    tools = [function("shell", {"command": {"type": "array", "items": text}, "workdir": text}, ["command"]),
             function("update_plan", {"plan": {"type": "array", "items": {"type": "object"}}}, ["plan"]),
             function("view_image", {"path": text}, ["path"]),
             function("read_file", {"path": text}, ["path"]),
             function("list_dir", {"path": text}, ["path"]),
             function("grep_files", {"pattern": text}, ["pattern"]),
             function("write_stdin", {"session_id": {"type": "integer"}, "chars": text}, ["session_id"]),
             function("exec_command", {"cmd": text}, ["cmd"]),
             dict(WEATHER),
             {"type": "web_search"}, {"type": "local_shell"}]
    return {
        "model": MODEL_ID,
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>sandbox: workspace-write</permissions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>cwd: /repo</environment_context>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        ],
        "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-codex-session",
        "text": {"verbosity": "low"}, "client_metadata": {"originator": "codex_exec"},
    }


def test_codex_shaped_request(scripted):
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", scripted.url + "/v1/responses", json=codex_request(), timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        if block.startswith(":"):  # a keep-alive comment
            continue
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        event = adapter.validate_python(json.loads(data[len("data: "):]))  # every event is an SDK type
        assert event.type == head[len("event: "):]
        events.append(event)
    final = events[-1].response
    check_events(events, final)
    assert final.status == "completed" and [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "get_weather"
    assert [t.name for t in final.tools] == ["shell", "update_plan", "view_image", "read_file", "list_dir",
                                             "grep_files", "write_stdin", "exec_command", "get_weather"]
    assert final.prompt_cache_key == "019a-codex-session" and final.parallel_tool_calls is False


def test_a_failed_generation_ends_the_stream_with_response_failed(scripted):
    """The event layer on its own: a reply cut by an engine error closes its open item as incomplete
    and ends with response.failed carrying the error (every event an SDK type)."""
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    request = GenerationRequest(prompt=scripted.state.encode("<u>Hi</s>A:"), max_tokens=8)
    out = OutputBuilder(scripted.state, request, Options())
    events = out.start() + out.step(Step([5, 6], "Hello")) + out.finish(
        Finished("error", GenerationStats(), error="RuntimeError: boom"))
    parsed = [adapter.validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    final = parsed[-1].response
    assert final.status == "failed" and final.error.code == "server_error" and "boom" in final.error.message
    assert final.output[0].status == "incomplete" and final.output_text == "Hello"
    check_events(parsed, final)


def test_a_reply_the_server_cancels_is_an_error_not_a_completed_response(endless):
    """Non-streamed: a 503 in OpenAI's shape (the SDK retries it); streamed: response.failed, the response
    cancelled with an error that says so, its open item incomplete (every event an SDK type)."""
    message = "the server cancelled this request before its reply was complete (it is shutting down); retry it"
    body = {"model": MODEL_ID, "input": "go on", "max_output_tokens": 4000}
    with LiveServer(*endless) as live:
        response = cancelled_by_the_server(live, "/v1/responses", body)
        assert response.status_code == 503 and response.json() == {"error": {
            "message": message, "type": "server_error", "param": None, "code": "server_shutting_down"}}
        response = cancelled_by_the_server(live, "/v1/responses", dict(body, stream=True))
        assert response.status_code == 200
        adapter = pydantic.TypeAdapter(ResponseStreamEvent)
        events = [adapter.validate_python(json.loads(frame.split("\n")[1][len("data: "):]))
                  for frame in response.text.strip().split("\n\n")]
        final = events[-1].response
        assert events[-1].type == "response.failed" and final.status == "cancelled"
        assert final.error.code == "server_error" and final.error.message == message
        assert [item.status for item in final.output] == ["incomplete"] and final.output_text
        check_events(events, final)
        assert live.wait_idle(30)
        reply = openai_client(live).responses.create(model=MODEL_ID, input="next", max_output_tokens=8)
        assert reply.status == "incomplete"  # the server serves on


# -- refusals, in OpenAI's error shape -----------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": "required"}, "tool_choice"),  # a call forced, no tool to call
    ({"tool_choice": {"type": "function", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    # allowed_tools with its tools not an array of tools, or a mode that allows none.
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": 5}, "tools": [WEATHER]}, "tool_choice.tools"),
    ({"tool_choice": {"type": "allowed_tools", "tools": True}, "tools": [WEATHER]}, "tool_choice.tools"),
    ({"tool_choice": {"type": "allowed_tools", "tools": ["get_weather"]}, "tools": [WEATHER]}, "tool_choice.tools"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "none", "tools": []}, "tools": [WEATHER]}, "tool_choice.mode"),
    ({"metadata": {"note": "cut \ud83d"}}, "metadata.note"),  # a lone surrogate: no Unicode text
])
def test_refusals_are_openai_errors(scripted, extra, param):
    body = json.dumps(dict({"model": MODEL_ID, "input": "Hi"}, **extra))  # ASCII: a lone surrogate as its escape
    reply = httpx.post(scripted.url + "/v1/responses", content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_sdk_raises_on_refusal(tools_client):
    with pytest.raises(openai.BadRequestError, match="stateless") as refused:
        tools_client.responses.create(model=MODEL_ID, input="Hi", store=True)
    assert refused.value.param == "store" and refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        tools_client.responses.create(model=MODEL_ID, input="Hi", tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_time"})


def test_forced_tool_call(tools_client):
    """'required' or a named function: decoded under the call grammar with thinking off (the scripted target
    answers '=' with prose; forced, it calls), never served as 'auto' (test_server_tool_choice.py: the rest)."""
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        forced = tools_client.responses.create(model=MODEL_ID, input=QUESTION, tools=[WEATHER], tool_choice=choice,
                                               max_output_tokens=16)
        assert [(o.type, o.name, json.loads(o.arguments)) for o in forced.output] == [
            ("function_call", "get_weather", {"city": "Paris"})]


def test_fields_a_local_model_ignores_are_accepted(tools_client):
    reply = tools_client.responses.create(
        model=MODEL_ID, input="Hi there", max_output_tokens=4, store=False, include=["reasoning.encrypted_content"],
        prompt_cache_key="k", metadata={"a": "b"}, user="u", safety_identifier="s", service_tier="auto",
        truncation="disabled", parallel_tool_calls=True, top_p=0.9, temperature=0.0,
        tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}],
        extra_body={"client_metadata": {"x": "y"}, "prompt_cache_retention": "24h"})
    assert reply.status in ("completed", "incomplete") and reply.metadata == {"a": "b"} and reply.tools == []


# -- structured output ------------------------------------------------------------------------
def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    reply = client.responses.create(model=MODEL_ID, input="Is it small?", max_output_tokens=200,
                                    text={"format": fmt})
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    value = json.loads(reply.output_text)
    assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("small", "large")
    free = client.responses.create(model=MODEL_ID, input="Is it small?", max_output_tokens=40)
    assert free.output_text != reply.output_text  # without the format the tiny target writes no JSON
    loose = client.responses.create(model=MODEL_ID, input="Is it small?", max_output_tokens=200,
                                    text={"format": {"type": "json_object"}})
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)
    else:
        assert loose.output_text.lstrip().startswith("{")


def test_text_format_refusals(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_ID, input="Hi", text={"format": {"type": "json_schema", "name": "x"}})
    assert refused.value.param == "text.format.schema"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_ID, input="Hi", text={"format": {"type": "yaml"}})
