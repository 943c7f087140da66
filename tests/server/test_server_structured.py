"""Structured output through the server: `response_format` json_object / json_schema replies are JSON
(the scripted target would rather answer with prose in a code fence), unsupported schemas get a 400,
and without `response_format` nothing changes."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from helpers.scripted import scripted_pair
from helpers.serverkit import MODEL_ID, LiveServer, openai_client

from mlx_dflash.server.http.errors import APIError
from mlx_dflash.server.reply.structured import PlainReply, format_kind

FENCED = '```json\n{"city": "Paris"}\n```'  # what the target wants to say
JSON_REPLY = '{"city": "Paris"}'  # its second choice
# Thinking off (Qwen3's switch) renders "<s></s>" first: two more prompt tokens, the same reply.
TEMPLATE = ("{%- if enable_thinking is defined and not enable_thinking %}<s></s>{% endif %}"
            "{%- for m in messages %}<{{ m.role[0] }}>{{ m.content }}</s>{% endfor %}"
            "{%- if add_generation_prompt %}A:{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A scripted target (scripted.py): after 'A:' the fenced reply (logit 50), else the bare JSON (25);
    after either, the end. A thinking model: mlx-lm renders with enable_thinking=True by default."""
    script = [(":", FENCED, 50.0), (":", JSON_REPLY, 25.0), (FENCED, "</s>", 50.0), (JSON_REPLY, "</s>", 50.0)]
    pair = scripted_pair(tmp_path_factory.mktemp("structured"), template=TEMPLATE,
                         strings=[FENCED, JSON_REPLY, "<think>", "</think>"], script=script)
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


QUESTION = [{"role": "user", "content": "Where is the Eiffel tower? Answer in JSON."}]


def ask(client, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=48, **kwargs)


def test_without_response_format_nothing_changes(client):
    for extra in ({}, {"response_format": {"type": "text"}}):
        reply = ask(client, **extra).choices[0]
        assert reply.message.content == FENCED and reply.finish_reason == "stop"


def test_json_object_reply_is_json(client):
    plain = ask(client)
    constrained = ask(client, response_format={"type": "json_object"})
    reply = constrained.choices[0]
    assert reply.message.content == JSON_REPLY and reply.finish_reason == "stop"
    # The template's thinking switch is turned off for a constrained reply (there is no room for thinking).
    assert constrained.usage.prompt_tokens == plain.usage.prompt_tokens + 2
    thinking = ask(client, response_format={"type": "json_object"}, extra_body={"chat_template_kwargs":
                                                                                {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens == plain.usage.prompt_tokens  # unless the request set it
    assert json.loads(reply.message.content) == {"city": "Paris"}
    chunks = list(ask(client, response_format={"type": "json_object"}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == JSON_REPLY


def test_json_schema_reply_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY, "strict": True}}
    reply = ask(client, response_format=fmt).choices[0]
    assert json.loads(reply.message.content) == {"city": "Paris"}
    # A schema the favourite replies break: the reply is still what the schema asks for.
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    reply = ask(client, response_format=fmt, temperature=0.0).choices[0]
    value = json.loads(reply.message.content)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool) and reply.finish_reason == "stop"


def test_sampled_json_object_reply_is_json(client):
    for seed in (1, 2):
        reply = ask(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed).choices[0]
        assert json.loads(reply.message.content) == {"city": "Paris"}


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}, "not"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "weird"}}},
     "weird"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "yaml"}, "response_format.type"),
    ("json", "response_format"),
])
def test_unsupported_formats_get_a_400(server, fmt, words):
    body = {"model": MODEL_ID, "messages": QUESTION, "response_format": fmt}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] + str(error["param"]) and error["param"].startswith("response_format")


def test_without_llguidance_a_clear_501(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    body = {"model": MODEL_ID, "messages": QUESTION, "response_format": {"type": "json_object"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 501 and "mlx-dflash[serve]" in r.json()["error"]["message"]


def test_format_kind_reads_every_api_shape():
    assert format_kind(None, "p") == ("text", None)
    assert format_kind({"type": "json_object"}, "p") == ("json_object", None)
    chat = {"type": "json_schema", "json_schema": {"name": "n", "schema": CITY, "strict": True}}
    flat = {"type": "json_schema", "name": "n", "schema": CITY, "strict": True}  # Responses, Anthropic
    assert format_kind(chat, "response_format") == format_kind(flat, "text.format") == ("json_schema", CITY)
    with pytest.raises(APIError) as e:
        format_kind({"type": "json_schema", "json_schema": {"schema": "nope"}}, "response_format")
    assert e.value.param == "response_format.json_schema.schema"
    parser = PlainReply()  # constrained output is all text: markup inside it stays text
    assert [d.text for d in parser.feed("<think>{") + parser.finish()] == ["<think>{"] and parser.calls == []
