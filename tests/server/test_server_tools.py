"""Tool calls through the server (OpenAI tool_calls, Anthropic tool_use), with the stop-string
filter tested on its own (the reply parser: test_server_reply.py)."""

from __future__ import annotations

import json

import pytest
from helpers.scripted import ANSWER, CALL, TEMPLATE, WEATHER, scripted_pair
from helpers.serverkit import MODEL_ID, LiveServer, anthropic_client, openai_client

from mlx_dflash.server.worker.text import TextFilter


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A scripted target (scripted.py): 'A:' -> a tool call, 'R=' -> an answer."""
    pair = scripted_pair(tmp_path_factory.mktemp("tools"), template=TEMPLATE, strings=[CALL, ANSWER],
                         script=[(":", CALL), (CALL, "</s>"), ("=", ANSWER), (ANSWER, "</s>")])
    with LiveServer(*pair) as live:
        yield live


def test_openai_tool_round_trip(server):
    client = openai_client(server)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER], max_tokens=16)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER],
                                                 max_tokens=16, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # no markup streamed as text
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = question + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = client.chat.completions.create(model=MODEL_ID, messages=history, tools=[WEATHER], max_tokens=16)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"

    plain = client.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER], tool_choice="none",
                                           max_tokens=16)
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls


def test_anthropic_tool_use_round_trip(server):
    client = anthropic_client(server)
    tools = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL_ID, max_tokens=16, tools=tools, messages=question)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")

    with client.messages.stream(model=MODEL_ID, max_tokens=16, tools=tools, messages=question) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.content[0].input == {"city": "Paris"}

    history = question + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}]},
    ]
    second = client.messages.create(model=MODEL_ID, max_tokens=16, tools=tools, messages=history)
    assert second.content[0].text == ANSWER and second.stop_reason == "end_turn"


def test_filter_holds_back_a_stop_string_split_across_pushes():
    text = TextFilter(["END"])
    assert text.push("abcE").text == "abc"
    assert text.push("N").text == ""
    released = text.push("Dxyz")
    assert released.text == "" and released.stop == "END"
    assert text.released == "abc"


def test_filter_releases_a_false_start():
    text = TextFilter(["END"])
    assert text.push("abE").text == "ab"
    assert text.push("Nx").text == "ENx"
    assert text.flush() == "" and text.released == "abENx"
    held = TextFilter(["END"])
    held.push("zzEN")
    assert held.flush() == "EN"  # generation ended: what was held back was no stop string


def test_chat_template_kwargs_reach_the_template(server):
    client = openai_client(server)
    question = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=MODEL_ID, messages=question, max_tokens=2)
    greeted = client.chat.completions.create(model=MODEL_ID, messages=question, max_tokens=2,
                                             extra_body={"chat_template_kwargs": {"greeting": "Hello!"}})
    assert greeted.usage.prompt_tokens == plain.usage.prompt_tokens + len("Hello!")
