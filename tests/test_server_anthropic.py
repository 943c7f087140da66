"""`dflash-mlx serve`, Anthropic side: /v1/messages (streaming and not) and count_tokens, official SDK."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from serverkit import MODEL_ID, LiveServer
from tiny import EOS_ID, greedy_reference, save_target, tiny_drafter, tiny_target

import mlx_dflash


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = save_target(tiny_target("qwen3", seed=0), "qwen3", tmp_path_factory.mktemp("target"))
    target, tokenizer, _ = mlx_dflash.load(str(path))
    return target, tokenizer, tiny_drafter(target, block_size=8)


@pytest.fixture(scope="module")
def server(pair):
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


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
    (dict(MESSAGE, stop_sequences="x"), 200, None),  # a single string is accepted as one stop sequence
    (dict(MESSAGE, model="claude-unknown"), 404, "not_found_error"),
]


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
