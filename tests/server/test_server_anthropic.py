"""`dflash-mlx serve`, Anthropic side: /v1/messages (streaming and not) and count_tokens, official SDK."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from helpers.serverkit import MODEL_ID, LiveServer, anthropic_client, cancelled_by_the_server, endless_pair, tiny_pair
from helpers.tiny import EOS_ID, greedy_reference

from mlx_dflash.server.apis import anthropic_api
from mlx_dflash.server.http.state import ServerState


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def server(pair):
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server)


@pytest.fixture(scope="module")
def endless(pair):
    """The tiny target with its end-of-sequence row zeroed: greedy replies never stop on their own."""
    return endless_pair(pair[1])


def expected_reply(pair, messages: list[dict], n: int) -> tuple[str, int, int]:
    """Reference text, prompt length and reply length of the target decoding alone."""
    model, tokenizer, _ = pair
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    out = greedy_reference(model, prompt, n)
    out = out[: out.index(EOS_ID)] if EOS_ID in out else out
    return tokenizer.decode(out), len(prompt), len(out)


def test_messages_greedy_equals_target_alone(pair, client):
    reply = client.messages.create(model=MODEL_ID, max_tokens=40, system="You are terse.",
                                   messages=[{"role": "user", "content": "Explain caches."}])
    text, prompt_len, n = expected_reply(pair, [{"role": "system", "content": "You are terse."},
                                                {"role": "user", "content": "Explain caches."}], 40)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL_ID
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == text
    assert reply.stop_reason == ("max_tokens" if n == 40 else "end_turn")
    assert reply.usage.output_tokens == n
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == prompt_len


def test_messages_stream_event_sequence(pair, client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Stream this."}]}]
    with client.messages.stream(model=MODEL_ID, max_tokens=30, messages=messages) as stream:
        events = list(stream)
        final = stream.get_final_message()
    text, _, n = expected_reply(pair, [{"role": "user", "content": "Stream this."}], 30)
    kinds = [e.type for e in events if e.type not in ("text",)]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert final.content[0].text == text and final.usage.output_tokens == n


def test_stop_sequences(pair, client):
    text, _, _ = expected_reply(pair, [{"role": "user", "content": "Go on."}], 60)
    stop = text[10:14]
    reply = client.messages.create(model=MODEL_ID, max_tokens=60, stop_sequences=[stop],
                                   messages=[{"role": "user", "content": "Go on."}])
    assert reply.content[0].text == text[: text.index(stop)]
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop


def test_count_tokens(pair, client):
    _, tokenizer, _ = pair
    counted = client.messages.count_tokens(model=MODEL_ID, messages=[{"role": "user", "content": "count me"}])
    assert counted.input_tokens == len(tokenizer.apply_chat_template([{"role": "user", "content": "count me"}],
                                                                     add_generation_prompt=True))


MESSAGE = {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ("{nope", 400, "invalid_request_error"),
    ({k: v for k, v in MESSAGE.items() if k != "max_tokens"}, 400, "invalid_request_error"),
    (dict(MESSAGE, max_tokens=0), 400, "invalid_request_error"),
    (dict(MESSAGE, temperature=1.5), 400, "invalid_request_error"),
    (dict(MESSAGE, top_p=0), 400, "invalid_request_error"),
    (dict(MESSAGE, messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error"),
    (dict(MESSAGE, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
     "invalid_request_error"),
    (json.dumps(dict(MESSAGE, system="cut \ud83d")), 400, "invalid_request_error"),  # a lone surrogate
    (json.dumps(dict(MESSAGE, temperature=1e-45)), 200, None),  # colder than the sampler can divide by: greedy
    (dict(MESSAGE, stop_sequences="x"), 200, None),  # a single string is accepted as one stop sequence
    # A text model: images and documents are refused by name, in messages, tool results and the system prompt.
    (dict(MESSAGE, messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), 400,
     "invalid_request_error"),
    (dict(MESSAGE, messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                            "content": [{"type": "image", "source": {}}]}]}]), 400,
     "invalid_request_error"),
    (dict(MESSAGE, system=[{"type": "image", "source": {}}]), 400, "invalid_request_error"),
    (dict(MESSAGE, messages=[{"role": "tool", "content": "x"}]), 400, "invalid_request_error"),
    (dict(MESSAGE, thinking={"type": "sometimes"}), 400, "invalid_request_error"),
    (dict(MESSAGE, thinking={"type": "enabled", "budget_tokens": "lots"}), 400, "invalid_request_error"),
    (dict(MESSAGE, output_config={"format": {"type": "json_schema"}}), 400, "invalid_request_error"),
    (dict(MESSAGE, tools=[{"name": 3, "input_schema": {}}]), 400, "invalid_request_error"),
    (dict(MESSAGE, tool_choice={"type": "any"}), 400, "invalid_request_error"),  # a call forced, no tool to call
    (dict(MESSAGE, tool_choice={"type": "sometimes"}), 400, "invalid_request_error"),
    (dict(MESSAGE, thinking={"type": "adaptive"}, output_config={"effort": "high"}, metadata={"user_id": "u"},
          context_management={"edits": []}, tools=[{"type": "web_search_20250305", "name": "web_search"}]), 200,
     None),
]


def test_a_reply_the_server_cancels_is_an_error_not_end_turn(endless):
    """Non-streamed: Anthropic's overloaded error (529, which clients retry); streamed: an `error` event
    ends the stream, with no message_delta whose stop_reason would pass the cut reply as whole."""
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": (
        "the server cancelled this request before its reply was complete (it is shutting down); retry it")}}
    body = {"model": MODEL_ID, "max_tokens": 4000, "messages": [{"role": "user", "content": "go on"}]}
    with LiveServer(*endless) as live:
        response = cancelled_by_the_server(live, "/v1/messages", body)
        assert response.status_code == 529 and response.json() == overloaded, response.text
        response = cancelled_by_the_server(live, "/v1/messages", dict(body, stream=True))
        assert response.status_code == 200
        frames = [frame.split("\n") for frame in response.text.strip().split("\n\n")]
        events = [(head[len("event: "):], json.loads(data[len("data: "):])) for head, data in frames]
        assert events[0][0] == "message_start" and events[-1] == ("error", overloaded)
        assert {kind for kind, _ in events[1:-1]} <= {"content_block_start", "content_block_delta"}
        assert live.wait_idle(30)
        reply = anthropic_client(live).messages.create(model=MODEL_ID, max_tokens=8,
                                                       messages=[{"role": "user", "content": "next"}])
        assert reply.stop_reason == "max_tokens"  # the server serves on


def test_bad_messages_get_anthropic_errors(server):
    for body, status, kind in BAD:
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        response = httpx.post(server.url + "/v1/messages", headers={"Content-Type": "application/json"}, **kwargs)
        assert response.status_code == status, (body, response.text)
        if kind is not None:
            payload = response.json()
            assert payload["type"] == "error" and payload["error"]["type"] == kind
            assert payload["error"]["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_bad_messages_name_the_field(server):
    image = dict(MESSAGE, messages=[{"role": "user", "content": [{"type": "text", "text": "see"},
                                                                 {"type": "image", "source": {}}]}])
    error = httpx.post(server.url + "/v1/messages", json=image).json()["error"]
    assert "messages.0.content.1" in error["message"] and "text model" in error["message"]
    choice = httpx.post(server.url + "/v1/messages", json=dict(MESSAGE, tool_choice={"type": "tool", "name": "f"}))
    assert choice.status_code == 400 and "tool_choice" in choice.json()["error"]["message"]  # no tool 'f' offered


SYSTEM_BLOCKS = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                 {"type": "text", "text": "Answer in English.", "cache_control": {"type": "ephemeral"}}]
# System messages inside `messages` (leading, and after the first turn) with earlier thinking blocks.
WITH_SYSTEM_MESSAGES = [
    {"role": "system", "content": "Project: caches."},
    {"role": "user", "content": "Explain caches."},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Short.", "signature": "abc"},
                                      {"type": "redacted_thinking", "data": "opaque"},
                                      {"type": "text", "text": "Caches keep data close."}]},
    {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]},
    {"role": "user", "content": [{"type": "text", "text": "Go on."}, {"type": "text", "text": "Please."}]},
]
# The same conversation as the template takes it: leading system text joined, later system messages in place.
AS_TEMPLATE_MESSAGES = [
    {"role": "system", "content": "You are terse.\n\nAnswer in English.\n\nProject: caches."},
    {"role": "user", "content": "Explain caches."},
    {"role": "assistant", "content": "Caches keep data close."},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Go on.\n\nPlease."},
]


def test_system_messages_inside_messages(pair, client):
    text, prompt_len, n = expected_reply(pair, AS_TEMPLATE_MESSAGES, 30)
    reply = client.messages.create(model=MODEL_ID, max_tokens=30, system=SYSTEM_BLOCKS, messages=WITH_SYSTEM_MESSAGES)
    assert reply.content[0].text == text and reply.usage.output_tokens == n
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == prompt_len
    with client.messages.stream(model=MODEL_ID, max_tokens=30, system=SYSTEM_BLOCKS,
                                messages=WITH_SYSTEM_MESSAGES) as stream:
        assert stream.get_final_message().content[0].text == text
    counted = client.messages.count_tokens(model=MODEL_ID, system=SYSTEM_BLOCKS, messages=WITH_SYSTEM_MESSAGES)
    assert counted.input_tokens == prompt_len


def test_claude_code_fields_and_headers_are_accepted(pair, server):
    """Fields a local model has no use for are accepted; Anthropic-defined tools are skipped; greedy stays exact."""
    body = {"model": MODEL_ID, "max_tokens": 24, "system": SYSTEM_BLOCKS[:1],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Explain caches.",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"}, "metadata": {"user_id": "u1"},
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}, "service_tier": "auto",
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                      {"type": "bash_20250124", "name": "bash"},
                      {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused",
               "anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
    reply = httpx.post(server.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    text, _, n = expected_reply(pair, [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "Explain caches."}], 24)
    assert reply.json()["content"] == [{"type": "text", "text": text}] and reply.json()["usage"]["output_tokens"] == n


STRICT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                   "{{ raise_exception('System role only at the start') }}{% endif %}"
                   "<{{ m.role[0] }}>{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


class StrictTemplateTokenizer:
    """The tiny tokenizer with a template that accepts a system message only first (as many do)."""

    chat_template = STRICT_TEMPLATE

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, chat_template=STRICT_TEMPLATE, **kwargs)


def test_later_system_messages_join_the_system_prompt_where_the_template_refuses_them(pair):
    state = ServerState(SimpleNamespace(tokenizer=StrictTemplateTokenizer(pair[1])), MODEL_ID)
    body = {"model": MODEL_ID, "system": SYSTEM_BLOCKS, "messages": WITH_SYSTEM_MESSAGES}
    folded = [dict(AS_TEMPLATE_MESSAGES[0], content=AS_TEMPLATE_MESSAGES[0]["content"] + "\n\nBe brief.")]
    folded += [m for m in AS_TEMPLATE_MESSAGES[1:] if m["role"] != "system"]
    assert anthropic_api.count_request(state, body) == list(pair[1].apply_chat_template(folded,
                                                                                       add_generation_prompt=True))
    # A template that takes them keeps them in place.
    state = ServerState(SimpleNamespace(tokenizer=pair[1]), MODEL_ID)
    assert anthropic_api.count_request(state, body) == list(
        pair[1].apply_chat_template(AS_TEMPLATE_MESSAGES, add_generation_prompt=True))


def test_claude_codes_billing_line_is_not_part_of_the_prompt(pair, client):
    """Claude Code's per-session billing line differs between sessions: dropped, two sessions with the
    same system prompt render the same prompt (and share its cache); the reply is the one without it."""
    messages = [{"role": "user", "content": "Hello"}]
    system = [{"type": "text", "text": "You are a coding agent."}]

    def rendered(suffix: str) -> list[dict]:
        billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix};"}
        return anthropic_api.template_messages({"system": [billing, *system], "messages": messages})

    alone = anthropic_api.template_messages({"system": system, "messages": messages})
    assert rendered("e77") == rendered("7a9") == alone
    assert anthropic_api.template_messages({"system": "x-anthropic-billing-header: a", "messages": messages}) == [
        {"role": "user", "content": "Hello"}]
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.e77;"}
    one = client.messages.create(model=MODEL_ID, max_tokens=8, system=[billing, *system], messages=messages)
    two = client.messages.create(model=MODEL_ID, max_tokens=8, system=system, messages=messages)
    assert one.content[0].text == two.content[0].text
