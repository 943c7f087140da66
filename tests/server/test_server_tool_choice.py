"""Forced tool calls through the server: `tool_choice` "required" or a named function (chat completions,
Responses), {"type": "any"} or {"type": "tool"} (Messages) are decoded under a grammar of the model's own
call markup, so the scripted target, which would rather answer in prose (or with a call whose arguments
break the schema), calls a tool; a model whose call format has no grammar here gets a 400, and "auto"
is unchanged."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
from helpers.scripted import scripted_pair, scripted_tokenizer
from helpers.serverkit import MODEL_ID, LiveServer, anthropic_client, openai_client

from mlx_dflash.decoding.constraint import TokenConstraint
from mlx_dflash.server.http.errors import APIError
from mlx_dflash.server.reply.structured import forced_call_parser, tool_choice_constraint

PLAIN = "It is sunny in Paris."  # what the target would rather say
BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}\n</tool_call>'  # its next choice: no city
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
# A Hermes/Qwen-like template with a thinking switch (thinking off renders "<s></s>" first: two more
# prompt tokens), tools listed, earlier calls as <tool_call> JSON.
TEMPLATE = (
    "{%- if enable_thinking is defined and not enable_thinking %}<s></s>{% endif %}"
    "{%- if tools %}<s>tools:{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<a>{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}</s>"
    "{%- else %}<{{ m.role[0] }}>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}A:{% endif %}"
)
# Qwen3-Coder's XML calls: no grammar for them here.
CODER_TEMPLATE = ("{%- for m in messages %}<{{ m.role[0] }}>{{ m.content }}</s>{% endfor %}"
                  "{#- <tool_call>\n<function=NAME> #}{%- if add_generation_prompt %}A:{% endif %}")
# Llama 3.x JSON calls, `{"name": ..., "parameters": ...}`, maybe after <|python_tag|>.
LLAMA_TEMPLATE = ('{#- "parameters" <|start_header_id|> #}{%- for m in messages %}{{ m.content }}{% endfor %}'
                  "{%- if add_generation_prompt %}A:{% endif %}")
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                         "parameters": TIME_PARAMS}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A scripted target (scripted.py): after 'A:' prose (logit 50), a call with bad arguments (40), the
    weather call (30), the time call (20); after the weather call the time call (50) before the end (40)."""
    script = [(":", PLAIN, 50.0), (":", BAD, 40.0), (":", WEATHER_CALL, 30.0), (":", TIME_CALL, 20.0),
              (WEATHER_CALL, TIME_CALL, 50.0), (WEATHER_CALL, "</s>", 40.0),
              (PLAIN, "</s>"), (BAD, "</s>"), (TIME_CALL, "</s>")]
    pair = scripted_pair(tmp_path_factory.mktemp("tool_choice"), template=TEMPLATE,
                         strings=[PLAIN, BAD, WEATHER_CALL, TIME_CALL, "<think>", "</think>"], script=script)
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    pair = scripted_pair(tmp_path_factory.mktemp("coder"), template=CODER_TEMPLATE, strings=[PLAIN],
                         script=[(":", PLAIN), (PLAIN, "</s>")])
    with LiveServer(*pair) as live:
        yield live


def ask(client, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=16,
                                          **kwargs)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_auto_is_unchanged(server):
    for extra in ({}, {"tool_choice": "auto"}):
        choice = ask(openai_client(server), **extra).choices[0]
        assert choice.message.content == PLAIN and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_required_calls_tools_with_valid_arguments(server):
    client = openai_client(server)
    plain = ask(client)
    reply = ask(client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    # The favourite call breaks the weather schema: the reply is the best call that follows it, then the next.
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens + 2  # thinking switched off
    one = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]

    chunks = list(ask(client, tool_choice="required", stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"zone": "CET"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_function_is_the_one_called(server):
    client = openai_client(server)
    choice = ask(client, tool_choice=named("get_time")).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {"zone": "CET"})]
    # Named get_weather: the time call the target would add next is not allowed, so the reply ends.
    choice = ask(client, tool_choice=named("get_weather"), stream=False).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    chunks = list(ask(client, tool_choice=named("get_time"), stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("extra, words", [
    ({"tool_choice": named("get_date")}, "get_date"),
    ({"tool_choice": "required", "tools": None}, "no tools"),
    ({"tool_choice": {"type": "function"}}, "function.name"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "odd", "parameters": {"type": "object", "not": {}}}}]}, "'odd'"),
])
def test_impossible_forced_calls_get_a_400(server, extra, words):
    body = dict({"model": MODEL_ID, "messages": QUESTION, "tools": [WEATHER, TIME], "max_tokens": 8}, **extra)
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and words in error["message"]


def test_anthropic_any_and_tool(server):
    client = anthropic_client(server)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]

    def ask_messages(**kwargs):
        return client.messages.create(model=MODEL_ID, max_tokens=16, tools=tools, messages=QUESTION, **kwargs)

    auto = ask_messages()
    assert auto.stop_reason == "end_turn" and [b.type for b in auto.content] == ["text"]
    forced = ask_messages(tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in forced.content] == [
        ("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_time", {"zone": "CET"})]
    one = ask_messages(tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.name for b in one.content] == ["get_weather"]
    with client.messages.stream(model=MODEL_ID, max_tokens=16, tools=tools, messages=QUESTION,
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_time", {"zone": "CET"})]
    # As Anthropic's API: a forced call leaves no room for thinking.
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        ask_messages(tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="get_date"):
        ask_messages(tool_choice={"type": "tool", "name": "get_date"})


def test_responses_required_and_named(server):
    client = openai_client(server)
    tools = [dict(t["function"], type="function") for t in (WEATHER, TIME)]
    auto = client.responses.create(model=MODEL_ID, input=QUESTION, tools=tools, max_output_tokens=16)
    assert auto.output_text == PLAIN
    forced = client.responses.create(model=MODEL_ID, input=QUESTION, tools=tools, tool_choice="required",
                                     max_output_tokens=16)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in forced.output] == [
        ("function_call", "get_weather", {"city": "Paris"}), ("function_call", "get_time", {"zone": "CET"})]
    assert forced.tool_choice == "required"
    with client.responses.stream(model=MODEL_ID, input=QUESTION, tools=tools, max_output_tokens=16,
                                 tool_choice={"type": "function", "name": "get_time"}) as stream:
        final = stream.get_final_response()
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [
        ("function_call", "get_time", {"zone": "CET"})]
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    only = client.responses.create(model=MODEL_ID, input=QUESTION, tools=tools, tool_choice=allowed,
                                   max_output_tokens=16)
    assert [o.name for o in only.output] == ["get_time"]


def test_a_call_format_without_a_grammar_gets_a_400(coder):
    tools = [WEATHER]
    for path, body in (
        ("/v1/chat/completions", {"messages": QUESTION, "tools": tools, "tool_choice": "required"}),
        ("/v1/responses", {"input": "Hi", "tools": [dict(WEATHER["function"], type="function")],
                           "tool_choice": "required"}),
        ("/v1/messages", {"messages": QUESTION, "max_tokens": 8, "tool_choice": {"type": "any"},
                          "tools": [{"name": "get_weather", "input_schema": WEATHER_PARAMS}]}),
    ):
        r = httpx.post(coder.url + path, json=dict(body, model=MODEL_ID), timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert "qwen3_coder" in r.text and "tool_choice" in r.text
    with pytest.raises(openai.BadRequestError, match="qwen3_coder"):
        openai_client(coder).chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=tools,
                                                     tool_choice=named("get_weather"))
    auto = openai_client(coder).chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=tools)
    assert auto.choices[0].message.content == PLAIN


def _walk(constraint: TokenConstraint, vocab: dict, pieces: list[str]) -> bool:
    """Whether the grammar takes `pieces` (tokens) one by one."""
    for piece in pieces:
        if not constraint.allowed()[vocab[piece]]:
            return False
        constraint.commit([vocab[piece]])
    return True


def test_llama3_json_calls(tmp_path):
    good = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    strings = [good, '{"name": "get_weather", "parameters": {"city": 5}}',
               '{"name": "get_weather", "arguments": {"city": "Paris"}}', "<|python_tag|>", PLAIN]
    tokenizer = scripted_tokenizer(tmp_path, LLAMA_TEMPLATE, strings)
    vocab = tokenizer.get_vocab()
    state = SimpleNamespace(tokenizer=tokenizer,
                            engine=SimpleNamespace(target=SimpleNamespace(vocab_size=len(vocab)), stop_ids={2}))

    def fresh(name=None, parallel=True) -> TokenConstraint:
        return tool_choice_constraint(state, [WEATHER, TIME], name, "tool_choice", parallel)()

    allowed = fresh().allowed()
    assert allowed[vocab[good]] and allowed[vocab["<|python_tag|>"]] and allowed[vocab["{"]]
    assert not any(allowed[vocab[s]] for s in strings[1:3] + [PLAIN]) and not allowed[2]
    assert _walk(fresh(), vocab, ["<|python_tag|>", good, "</s>"])
    assert _walk(fresh(), vocab, [good, ";", " ", good, "</s>"])
    one = fresh(parallel=False)
    assert _walk(one, vocab, [good]) and one.complete
    assert not fresh("get_time").allowed()[vocab[good]]
    parser = forced_call_parser(state, [WEATHER], "call_")
    parser.feed(good + "; " + good)
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", {"city": "Paris"})] * 2


def test_unsupported_format_is_named(tmp_path):
    tokenizer = scripted_tokenizer(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}", [])
    state = SimpleNamespace(tokenizer=tokenizer, engine=None)
    with pytest.raises(APIError) as refused:
        tool_choice_constraint(state, [WEATHER], None, "tool_choice")
    assert refused.value.status == 400 and "none found" in refused.value.message
