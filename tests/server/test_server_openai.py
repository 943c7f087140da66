"""`dflash-mlx serve`, OpenAI side, over a live server: the official SDK, curl, many clients, bad input.

Every reply is checked against the target decoding alone (mlx-lm's generate_step) or
against `mlx_dflash.generate` with the same drafter, on tiny random models.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import httpx
import mlx.core as mx
import openai
import pytest
from helpers.serverkit import MODEL_ID, LiveServer, cancelled_by_the_server, endless_pair, openai_client, tiny_pair
from helpers.tiny import EOS_ID, greedy_reference

import mlx_dflash
from mlx_dflash.server.http.errors import APIError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def server(pair):
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def reference_ids(model, prompt: list[int], n: int) -> list[int]:
    out = greedy_reference(model, prompt, n)
    return out[: out.index(EOS_ID)] if EOS_ID in out else out


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def test_chat_greedy_equals_target_alone_and_generate(pair, client):
    model, tokenizer, drafter = pair
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is speculative decoding?"}], max_tokens=40)
    prompt = chat_ids(tokenizer, "What is speculative decoding?")
    expected = reference_ids(model, prompt, 40)
    assert reply.choices[0].message.content == tokenizer.decode(expected)
    assert reply.choices[0].message.content == mlx_dflash.generate(model, tokenizer, prompt, draft_model=drafter,
                                                                   max_tokens=40)
    assert reply.choices[0].finish_reason == ("length" if len(expected) == 40 else "stop")
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.usage.total_tokens == len(prompt) + len(expected)
    extension = reply.model_extra["dflash"]
    assert extension["drafter"] is True and extension["cycles"] >= 1 and extension["prompt_lookup"] is True
    assert sum(extension["acceptance_histogram"]) == extension["cycles"]
    # Proposed tokens kept or discarded, in total and per source.
    details = reply.usage.completion_tokens_details
    accepted, proposed = extension["accepted_by_source"], extension["proposed_by_source"]
    assert details.accepted_prediction_tokens == sum(accepted.values()) < len(expected)
    assert details.rejected_prediction_tokens == sum(proposed.values()) - sum(accepted.values())
    assert set(proposed) <= {"dflash", "lookup"}
    histogram = extension["acceptance_histogram"]  # cycles by tokens committed: accepted + 1
    assert sum(n * count for n, count in enumerate(histogram)) - extension["cycles"] == sum(accepted.values())


def test_chat_stream_matches_and_reports_usage(pair, client):
    model, tokenizer, _ = pair
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        add_generation_prompt=True))
    expected = reference_ids(model, prompt, 30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(expected)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids_stream_and_not(pair, client):
    model, tokenizer, _ = pair
    prompt = tokenizer.encode("The quick brown fox")
    expected = tokenizer.decode(reference_ids(model, prompt, 32))
    plain = client.completions.create(model=MODEL_ID, prompt="The quick brown fox", max_tokens=32)
    assert plain.object == "text_completion" and plain.choices[0].text == expected
    streamed = list(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=32, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string_spanning_blocks_is_never_streamed(pair, client):
    model, tokenizer, _ = pair
    prompt_text = "Tell me a story."
    full = tokenizer.decode(reference_ids(model, chat_ids(tokenizer, prompt_text), 60))
    assert len(full) >= 24, "the tiny model's reply is too short for this test"
    stop = full[14:19]  # five characters: more than one verify cycle of this drafter commits
    expected = full[: full.index(stop)]
    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": prompt_text}], max_tokens=60, stream=True,
        stop=["\u2603 never", stop]))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": prompt_text}],
                                           max_tokens=60, stop=stop)
    assert plain.choices[0].message.content == expected and plain.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int, stream: bool = False) -> str:
        kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Pick words."}], max_tokens=24,
                      temperature=1.0, top_p=0.95, seed=seed)
        if stream:
            return "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
        return client.chat.completions.create(**kwargs).choices[0].message.content

    first = sample(7)
    assert sample(7) == first  # the second run starts from the prompt cache
    assert sample(7, stream=True) == first
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_logprobs_are_the_targets_own(pair, client):
    model, tokenizer, _ = pair
    prompt = chat_ids(tokenizer, "Logprobs please")
    expected = reference_ids(model, prompt, 12)
    reply = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Logprobs please"}],
                                           max_tokens=12, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected)
    logits = model(mx.array(prompt + expected, dtype=mx.uint32)[None])[0].astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, (entry, token) in enumerate(zip(content, expected, strict=True)):
        row = rows[len(prompt) - 1 + i]
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-3)
        top = mx.argsort(-row)[:3].tolist()
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([row[t].item() for t in top], abs=1e-3)
    completion = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, logprobs=2)
    assert len(completion.choices[0].logprobs.token_logprobs) == len(reference_ids(model, prompt, 12))


def test_logprobs_of_tokens_a_grammar_rules_out_are_openais_floor(server):
    """Structured output masks tokens to -inf, which JSON cannot carry: they read -9999.0, as in OpenAI's API."""
    body = dict(CHAT, logprobs=True, top_logprobs=20, response_format={"type": "json_object"})
    plain = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert plain.status_code == 200, plain.text
    content = plain.json()["choices"][0]["logprobs"]["content"]
    streamed = httpx.post(server.url + "/v1/chat/completions", json=dict(body, stream=True))
    chunks = [json.loads(block[len("data: "):], parse_constant=lambda word: pytest.fail(f"{word} is not JSON"))
              for block in streamed.text.split("\n\n")[:-2]]
    assert [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])] == content
    tops = [t["logprob"] for entry in content for t in entry["top_logprobs"]]
    assert len(tops) == 20 * len(content) and -9999.0 in tops and min(tops) == -9999.0


def test_sampled_logprobs_are_the_targets_own(pair, client):
    model, tokenizer, _ = pair
    prompt = chat_ids(tokenizer, "Sample with logprobs")
    reply = client.chat.completions.create(model=MODEL_ID, max_tokens=12, temperature=1.0, seed=11, logprobs=True,
                                           messages=[{"role": "user", "content": "Sample with logprobs"}])
    by_text = {}
    for i in range(model.args.vocab_size):
        by_text.setdefault(tokenizer.decode([i]), []).append(i)
    content = reply.choices[0].logprobs.content
    ids = [by_text[entry.token][0] for entry in content]
    assert all(len(by_text[entry.token]) == 1 for entry in content)
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    logits = model(mx.array(prompt + ids, dtype=mx.uint32)[None])[0].astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry.logprob == pytest.approx(rows[len(prompt) - 1 + i, token].item(), abs=1e-3)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL_ID


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_curl_sse_framing(server):
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": True})
    raw = subprocess.run(["curl", "-sN", "--max-time", "60", server.url + "/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=90, check=True).stdout
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert len(events) >= 3
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[len("data: "):])["object"] == "chat.completion.chunk"


def test_eight_concurrent_streams_each_equal_their_solo_run(pair, server):
    model, tokenizer, _ = pair
    questions = [f"Question number {i}: why?" for i in range(8)]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        client = openai_client(server, timeout=120)
        stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": questions[i]}],
                                                max_tokens=24, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(8))
    for i, question in enumerate(questions):
        assert results[i] == tokenizer.decode(reference_ids(model, chat_ids(tokenizer, question), 24)), i


@pytest.fixture(scope="module")
def endless(pair):
    """The tiny target with its end-of-sequence row zeroed: greedy replies never stop on their own."""
    return endless_pair(pair[1])


def test_dropped_stream_stops_its_generation_and_the_next_request_is_served(endless):
    model, tokenizer, drafter = endless
    with LiveServer(model, tokenizer, drafter) as live:
        body = {"model": MODEL_ID, "prompt": "forever and ever", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(4)]
        # Two chunks (each an event line and its blank line) of the greedy reply's start, not finished.
        assert received[1] == received[3] == "" and all(line.startswith("data: {") for line in received[::2])
        chunks = [json.loads(line[len("data: "):]) for line in received[::2]]
        assert all(c["object"] == "text_completion" and c["choices"][0]["finish_reason"] is None for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text and tokenizer.decode(greedy_reference(model, tokenizer.encode("forever and ever"), 48)) \
            .startswith(text)
        assert live.wait_idle(60), "the dropped generation did not stop"
        sessions = [s for s, _ in live.engine.prompt_cache._entries.values()]
        prompt = tokenizer.encode("forever and ever")
        assert len(sessions) == 1 and len(sessions[0].tokens) < len(prompt) + 4000
        client = openai_client(live)
        reply = client.completions.create(model=MODEL_ID, prompt="next one", max_tokens=16)
        assert reply.choices[0].text == tokenizer.decode(greedy_reference(model, tokenizer.encode("next one"), 16))


SERVER_CANCELLED_MESSAGE = ("the server cancelled this request before its reply was complete (it is shutting "
                            "down); retry it")


def test_a_reply_the_server_cancels_is_an_error_not_a_finished_reply(endless):
    """Non-streamed: a 503 in OpenAI's shape (the SDK retries it); streamed: the error chunk, then [DONE]."""
    shutting_down = {"error": {"message": SERVER_CANCELLED_MESSAGE, "type": "server_error", "param": None,
                               "code": "server_shutting_down"}}
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000}
    with LiveServer(*endless) as live:
        for route, body in (("/v1/chat/completions", chat),
                            ("/v1/completions", {"model": MODEL_ID, "prompt": "go on", "max_tokens": 4000})):
            response = cancelled_by_the_server(live, route, body)
            assert response.status_code == 503 and response.json() == shutting_down, (route, response.text)
        response = cancelled_by_the_server(live, "/v1/chat/completions", dict(chat, stream=True))
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        events = [json.loads(block[len("data: "):]) for block in response.text.split("\n\n")[:-2]]
        assert events[-1] == shutting_down
        assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
        assert live.wait_idle(30)
        reply = openai_client(live).completions.create(model=MODEL_ID, prompt="next one", max_tokens=8)
        assert reply.choices[0].finish_reason == "length"  # the server serves on


def test_openai_error_types_are_openais():
    """OpenAI's types: `server_error` for the server's failures, `invalid_request_error` with a code
    (invalid_api_key, model_not_found, ...) for every client error, whatever the status."""
    for status in (400, 401, 403, 404, 413, 415, 422):
        assert APIError(status, "x").openai_type == "invalid_request_error", status
    for status in (500, 501, 503):
        assert APIError(status, "x").openai_type == "server_error", status


def test_openai_errors_name_the_case_in_code_not_type(pair):
    with LiveServer(*pair, strict_model_name=True) as live:
        chat = live.url + "/v1/chat/completions"
        cases = [(httpx.post(chat, json=dict(CHAT, model="gpt-4o")), 404, "model_not_found"),
                 (httpx.get(live.url + "/v1/models/gpt-4o"), 404, "model_not_found"),
                 (httpx.post(chat, json=CHAT, headers={"Origin": "https://evil.example"}), 403, "origin_not_allowed"),
                 (httpx.post(live.url + "/v1/nowhere", json=CHAT), 404, None)]
        for response, status, code in cases:
            error = response.json()["error"]
            assert response.status_code == status and error["type"] == "invalid_request_error", response.text
            assert error["code"] == code and error["message"], response.text
        with pytest.raises(openai.NotFoundError):
            openai_client(live).chat.completions.create(model="gpt-4o", messages=CHAT["messages"], max_tokens=2)


def test_api_key(pair):
    with LiveServer(*pair, api_key="sesame") as live:
        body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}
        refused = httpx.post(live.url + "/v1/completions", json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "invalid_request_error"  # OpenAI's type; the code tells why
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        anthropic_shape = httpx.post(live.url + "/v1/messages", json=body)
        assert anthropic_shape.status_code == 401 and anthropic_shape.json()["type"] == "error"
        assert httpx.post(live.url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(live.url + "/v1/models", headers={"x-api-key": "sesame"}).status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()


CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    # (route, body or raw text, status, offending field or None)
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model"),
    ("/v1/chat/completions", dict(CHAT, messages="hi"), 400, "messages"),
    ("/v1/chat/completions", dict(CHAT, messages=[]), 400, "messages"),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages[0].content"),
    ("/v1/chat/completions", dict(CHAT, max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, max_tokens="ten"), 400, "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, max_completion_tokens=-3), 400, "max_completion_tokens"),
    ("/v1/chat/completions", dict(CHAT, temperature=-0.5), 400, "temperature"),
    ("/v1/chat/completions", dict(CHAT, top_p=0), 400, "top_p"),
    ("/v1/chat/completions", dict(CHAT, top_p=1.5), 400, "top_p"),
    ("/v1/chat/completions", dict(CHAT, n=2), 400, "n"),
    ("/v1/chat/completions", dict(CHAT, stop=5), 400, "stop"),
    ("/v1/chat/completions", dict(CHAT, stream="yes"), 400, "stream"),
    ("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", dict(CHAT, seed="x"), 400, "seed"),
    ("/v1/chat/completions", dict(CHAT, chat_template_kwargs={"tokenize": False}), 400, "chat_template_kwargs"),
    ("/v1/chat/completions", dict(CHAT, chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("/v1/completions", {"model": MODEL_ID, "prompt": {"text": "x"}}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_ID, "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_ID, "prompt": "ab" * 2100}, 400, "prompt"),
    # Lone surrogates (JSON escapes with no pair): no Unicode text, so no tokenizer or reply may meet them.
    ("/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "cut \ud83d"}), 400, "prompt"),
    ("/v1/chat/completions", json.dumps(dict(CHAT, messages=[{"role": "user", "content": ["\udc00"]}])), 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", json.dumps(dict(CHAT, user={"\udc00": 1})), 400, "user.\\udc00"),
    ("/v1/nowhere", CHAT, 404, None),
]


def test_bad_requests_get_openai_errors_and_the_server_lives(server):
    for route, body, status, param in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        response = httpx.post(server.url + route, headers={"Content-Type": "application/json"}, **kwargs)
        assert response.status_code == status, (route, body, response.text)
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], (route, body)
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, (route, body, error)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_sampling_too_narrow_for_float32_is_greedy(client):
    """A temperature under 1e-6 is greedy decoding, and a top-p under 1e-6 keeps the top token alone: the
    sampler's 1/temperature cannot overflow into NaN logits, nor a top-p round to 0 and keep no token
    (garbage tokens, and a 500 where a grammar refuses them)."""
    def ask(temperature: float, **extra) -> str:
        return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Cold."}],
                                              max_tokens=6, temperature=temperature, **extra).choices[0].message.content

    greedy = ask(0.0)
    assert ask(1e-45) == ask(1e-40) == ask(1.0, top_p=1e-300) == ask(1.0, top_p=1e-46) == greedy
    json_object = {"response_format": {"type": "json_object"}}
    assert ask(1e-45, **json_object) == ask(1.0, top_p=1e-300, **json_object) == ask(0.0, **json_object)


def test_token_logprobs_read_each_tokens_row():
    from mlx_dflash.server.worker.jobs import token_logprobs

    rows = mx.log(mx.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    first, second = token_logprobs(rows, [0, 2], top=2)
    assert first.logprob == pytest.approx(float(mx.log(mx.array(0.7)).item())) and [t for t, _ in first.top] == [0, 1]
    assert second.logprob == pytest.approx(float(mx.log(mx.array(0.8)).item())) and [t for t, _ in second.top] == [2, 0]
    (only,) = token_logprobs(rows[1:], [1], top=0)
    assert only.logprob == pytest.approx(float(mx.log(mx.array(0.1)).item())) and only.top == []
    assert token_logprobs(rows, [], top=2) == []


def test_event_logprobs_are_the_rows_each_token_was_sampled_from(targets, drafters, make_tokenizer):
    """Every event's rows, plain steps launched ahead included, are the target's own
    distribution at that token: the same as a plain forward over the whole text."""
    from helpers.tiny import VOCAB, ScriptedProposer, greedy_reference

    from mlx_dflash import stream_generate

    model = targets("qwen3")
    prompt = [5, 17, 33, 90, 41, 7]
    reference = greedy_reference(model, prompt, 40)
    for proposer in (ScriptedProposer(prompt + reference, VOCAB, 0.3, seed=1, target_layer_ids=[0, 2]), None):
        events = list(stream_generate(model, make_tokenizer(()), prompt, draft_model=proposer, max_tokens=30))
        tokens = [t for e in events for t in e.tokens]
        rows = mx.concatenate([e.logprobs.reshape(-1, e.logprobs.shape[-1]) for e in events if e.tokens])
        logits = model(mx.array(prompt + tokens)[None])[0, len(prompt) - 1 : -1]
        expected = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        assert tokens == reference[:30] and rows.shape == expected.shape
        assert mx.allclose(rows, expected, atol=1e-4).item()


def test_ctrl_c_ends_streams_in_flight_cleanly(endless):
    import signal

    model, tokenizer, drafter = endless
    live = LiveServer(model, tokenizer, drafter).__enter__()
    try:
        body = {"model": MODEL_ID, "prompt": "on and on", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            live.server.handle_exit(signal.SIGINT, None)  # what Ctrl-C calls
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        # The cut reply ends with an error, never a finish reason a client would take for a whole reply.
        assert json.loads(rest[-2][len("data: "):]) == {"error": {
            "message": SERVER_CANCELLED_MESSAGE, "type": "server_error", "param": None, "code": "server_shutting_down"}}
        assert not any(c["finish_reason"] for line in rest[:-2] for c in json.loads(line[len("data: "):])["choices"])
        live.thread.join(30)
        assert not live.thread.is_alive()
    finally:
        live.__exit__(None, None, None)
