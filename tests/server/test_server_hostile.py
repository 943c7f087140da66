"""Hostile input and server limits, over a live server: sampling fields a worker cannot take,
deep, large, mistyped and cross-site bodies, a full queue, keep-alives during a long prefill,
cancellation between prefill chunks, failed requests that keep their conversation, regenerated
replies served from the cache on every cache family, lenient model names and the context error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest
from helpers.families import build
from helpers.serverkit import MODEL_ID, LiveServer, anthropic_client, openai_client
from helpers.tiny import EOS_ID, greedy_reference, tiny_drafter, tiny_target, tiny_tokenizer

from mlx_dflash.decoding import session as session_module
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.server import EngineConfig
from mlx_dflash.server.apis import openai_api
from mlx_dflash.server.http.guard import MAX_JSON_DEPTH, json_depth
from mlx_dflash.server.http.sse import KEEPALIVE, with_keepalive
from mlx_dflash.server.worker import prefill_progress
from mlx_dflash.server.worker.prompt_cache import PromptCache, session_bytes
from mlx_dflash.targets.model import TargetModel

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGE = {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
JSON = {"Content-Type": "application/json"}


class GatedTarget(TargetModel):
    """Records each target forward's width; can hold the n-th one until `gate` opens, or fail it."""

    def __init__(self, model):
        super().__init__(model)
        self.fed: list[int] = []
        self.hold_at: int | None = None
        self.fail_at: int | None = None
        self.holding = threading.Event()
        self.gate = threading.Event()

    def reset(self, hold_at: int | None = None, fail_at: int | None = None) -> None:
        self.fed.clear()
        self.hold_at, self.fail_at = hold_at, fail_at
        self.holding.clear()
        self.gate.clear()

    def forward(self, tokens, cache, *args, **kwargs):
        self.fed.append(tokens.shape[1])
        if len(self.fed) == self.hold_at:
            self.holding.set()
            assert self.gate.wait(30), "the test never opened the gate"
        out = super().forward(tokens, cache, *args, **kwargs)
        if len(self.fed) == self.fail_at:  # after the cache was written: the session is left mid-cycle
            raise RuntimeError("injected failure")
        return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", seed=0)


@pytest.fixture(scope="module")
def gated(model, tokenizer):
    """One live server over a gated attention target (with a drafter) for the tests that do not
    need their own settings."""
    target = GatedTarget(model)
    with LiveServer(target, tokenizer, tiny_drafter(model, block_size=6), keepalive_seconds=0.2) as live:
        yield live, target


def post(live, route: str, body, headers: dict | None = None, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(live.url + route, content=content, headers=headers if headers is not None else JSON,
                      timeout=60, **kwargs)


def reference_text(model, tokenizer, prompt: list[int], n: int) -> str:
    out = greedy_reference(model, prompt, n)
    return tokenizer.decode(out[: out.index(EOS_ID)] if EOS_ID in out else out)


def prompt_of(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def wait_cancelled(live, failure: str, timeout: float = 30) -> None:
    """Until the running request is marked cancelled (`failure` if it is not within `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not (live.engine._current is not None and live.engine._current.cancelled.is_set()):
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


# -- sampling fields ----------------------------------------------------------------------
def test_sampling_fields_the_worker_cannot_take_are_refused_or_mapped(gated, model, tokenizer):
    live, _ = gated
    sampled = dict(CHAT, temperature=1.0, max_tokens=6)
    texts = []
    for seed in (-5, -5, (1 << 63) - 1, -(1 << 63)):  # any int64; a negative seed still names one sequence
        reply = post(live, "/v1/chat/completions", dict(sampled, seed=seed))
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] and texts[0]

    def content(route: str, body: dict) -> str:
        reply = post(live, route, body)
        assert reply.status_code == 200, (body, reply.text)
        if route == "/v1/messages":
            return "".join(block["text"] for block in reply.json()["content"])
        return reply.json()["choices"][0]["message"]["content"]

    # top_k >= the vocabulary (or -1) is no top-k: a greedy reply is the target's own, a sampled one as without it.
    greedy = reference_text(model, tokenizer, prompt_of(tokenizer, CHAT["messages"]), CHAT["max_tokens"])
    assert greedy
    for body in (dict(CHAT, top_k=100000), dict(CHAT, top_k=-1)):
        assert content("/v1/chat/completions", body) == greedy, body
    assert content("/v1/messages", dict(MESSAGE, top_k=100000)) == greedy
    assert content("/v1/chat/completions", dict(sampled, top_k=100000, seed=3)) == \
        content("/v1/chat/completions", dict(sampled, seed=3))
    reply = post(live, "/v1/completions", {"model": MODEL_ID, "prompt": [5] * 4090, "max_tokens": 10 ** 18,
                                           "seed": -(1 << 63), "temperature": 0.5})
    choice = reply.json()["choices"][0]
    assert reply.status_code == 200 and choice["finish_reason"] == "length" and choice["text"]
    assert reply.json()["usage"]["completion_tokens"] == 6  # cut to the context: 4096 - 4090
    refused = [
        ("/v1/chat/completions", dict(CHAT, seed=1 << 63), "seed"),
        ("/v1/chat/completions", dict(CHAT, seed=(1 << 64) - 5), "seed"),
        ("/v1/chat/completions", dict(CHAT, seed=-(1 << 63) - 1), "seed"),
        ("/v1/chat/completions", dict(CHAT, top_k=-5), "top_k"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                 '"temperature": NaN}', None),
        ("/v1/chat/completions", json.dumps(CHAT)[:-1] + ', "temperature": 1e400}', "temperature"),  # inf
        ("/v1/chat/completions", '{"model": "tiny", "messages": [], "max_tokens": 1' + "0" * 5000 + "}", None),
        ("/v1/chat/completions", dict(CHAT, min_p=2.0), "min_p"),
        ("/v1/chat/completions", dict(CHAT, stop=["x" * 5000]), "stop"),
        ("/v1/chat/completions", dict(CHAT, stop=["s"] * 17), "stop"),
        ("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
        ("/v1/chat/completions", dict(CHAT, n=3), "n"),
        ("/v1/chat/completions", dict(CHAT, max_tokens=1.5), "max_tokens"),
        ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
         "messages[0].content"),
        ("/v1/completions", {"model": MODEL_ID, "prompt": [5, -1]}, "prompt"),
        ("/v1/completions", {"model": MODEL_ID, "prompt": [5, True]}, "prompt"),
        ("/v1/messages", dict(MESSAGE, top_k=-3), None),
        ("/v1/messages", dict(MESSAGE, temperature=float("inf")), None),
        ("/v1/messages", dict(MESSAGE, stop_sequences=["y" * 5000]), None),
    ]
    deep = "[" * 100_000 + "]" * 100_000
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/completions"):
        refused.append((route, deep, None))
        refused.append((route, '{"model": "tiny", "x": ' + deep + "}", None))
    for route, body, param in refused:
        reply = post(live, route, body)
        assert reply.status_code == 400, (route, str(body)[:200], reply.text[:300])
        if body is deep:
            assert "nested too deeply" in reply.text
        if route == "/v1/messages":
            assert reply.json()["error"]["type"] == "invalid_request_error"
        else:
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and len(error["message"]) < 500
            if param is not None:
                assert error["param"] == param, error
    assert live.wait_idle() and httpx.get(live.url + "/health").json()["status"] == "ok"


# -- bodies --------------------------------------------------------------------------------
def test_json_depth_is_read_without_recursion_and_ignores_brackets_in_strings():
    assert json_depth(b'{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth(b'"\\"[[[" ') == 0
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000
    assert json_depth(b'["\\\\", [["\\\\\\"]"]]]') == 3  # runs of backslashes: even ones end the string


@pytest.mark.parametrize("unit", [b'\\"', b'\\\\', b'"[', b"[", b'\\\\\\"{'])
def test_json_depth_takes_time_linear_in_the_body(unit):
    """Unterminated strings of escaped quotes made a regex that retried from every quote take
    quadratic time (32 KB: 3 s, 1 MB: about an hour); every body scans in well under a second."""
    for size in (1 << 16, 1 << 21):  # the small one first: a quadratic scan fails it in seconds, not hours
        body = b'{"model": "' + unit * (size // len(unit))
        start = time.monotonic()
        json_depth(body)
        assert time.monotonic() - start < 2, (unit, size)


def test_deep_large_and_mistyped_bodies(model, tokenizer):
    with LiveServer(model, tokenizer, max_body_bytes=4096) as live:
        deep = "[" * 100_000 + "]" * 100_000
        for route in ("/v1/chat/completions", "/v1/messages"):
            reply = post(live, route, deep[:2000] + deep[-2000:])  # within the size limit, 1000 levels
            assert reply.status_code == 400 and "nested too deeply" in reply.text
        nested: dict = {"x": 1}
        for _ in range(MAX_JSON_DEPTH - 2):  # in CHAT: nested exactly as deep as allowed
            nested = {"x": nested}
        assert post(live, "/v1/chat/completions", dict(CHAT, metadata=nested)).status_code == 200
        assert post(live, "/v1/chat/completions", dict(CHAT, metadata={"x": nested})).status_code == 400
        big = dict(CHAT, messages=[{"role": "user", "content": "x" * 5000}])
        reply = post(live, "/v1/chat/completions", big)
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
        reply = post(live, "/v1/messages", dict(MESSAGE, system="y" * 5000))
        assert reply.status_code == 413 and reply.json()["error"]["type"] == "request_too_large"

        def chunks():  # no Content-Length: refused while it is read
            yield json.dumps(CHAT)[:-1].encode()
            for _ in range(10):
                yield b' ' * 1000
            yield b"}"

        reply = httpx.post(live.url + "/v1/chat/completions", content=chunks(), headers=JSON, timeout=60)
        assert reply.status_code == 413
        for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
            reply = post(live, "/v1/chat/completions", CHAT, headers=headers)
            assert reply.status_code == 415, (headers, reply.text)
            assert reply.json()["error"]["type"] == "invalid_request_error"
        assert post(live, "/v1/messages", MESSAGE, headers={"Content-Type": "text/plain"}).json()["type"] == "error"
        reply = post(live, "/v1/chat/completions", CHAT, headers={"Content-Type": "application/json; charset=utf-8"})
        assert reply.status_code == 200
        assert httpx.get(live.url + "/health").json()["status"] == "ok"


# -- origins -------------------------------------------------------------------------------
def test_cross_site_requests_are_refused_unless_allowed(model, tokenizer):
    evil = {"Origin": "https://evil.example", **JSON}
    with LiveServer(model, tokenizer) as live:
        reply = post(live, "/v1/chat/completions", CHAT, headers=evil)
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "origin_not_allowed"
        reply = post(live, "/v1/messages", MESSAGE, headers=evil)
        assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error"
        assert httpx.get(live.url + "/health", headers=evil).status_code == 403
        preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        assert httpx.options(live.url + "/v1/chat/completions", headers=preflight).status_code == 403
        for origin in (live.url, "http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:80"):
            reply = post(live, "/v1/chat/completions", CHAT, headers={"Origin": origin, **JSON})
            assert reply.status_code == 200, origin
        assert post(live, "/v1/chat/completions", CHAT).status_code == 200  # no Origin: not a browser page
    with LiveServer(model, tokenizer, allow_origins=["https://app.example"], api_key="k") as live:
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        reply = httpx.options(live.url + "/v1/chat/completions", headers=preflight)  # no key: browsers send none
        assert reply.status_code == 204
        assert reply.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in reply.headers["access-control-allow-methods"]
        assert "authorization" in reply.headers["access-control-allow-headers"]
        allowed = {"Origin": "https://app.example", "Authorization": "Bearer k", **JSON}
        reply = post(live, "/v1/chat/completions", CHAT, headers=allowed)
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
        assert post(live, "/v1/chat/completions", CHAT, headers={**evil, "Authorization": "Bearer k"}).status_code \
            == 403
    with LiveServer(model, tokenizer, allow_origins=["*"]) as live:
        assert post(live, "/v1/chat/completions", CHAT, headers=evil).status_code == 200


def test_a_page_rebinding_its_name_to_loopback_is_refused(model, tokenizer):
    """DNS rebinding: a page at evil.example:8080 whose name then resolves to 127.0.0.1 is same-origin
    to the browser (Origin and Host both name evil.example:8080); the server answers loopback names only."""
    rebound = {"Origin": "http://evil.example:8080", "Host": "evil.example:8080", **JSON}
    with LiveServer(model, tokenizer) as live:
        reply = post(live, "/v1/chat/completions", CHAT, headers=rebound)
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "host_not_allowed", reply.text
        reply = post(live, "/v1/messages", MESSAGE, headers=rebound)
        assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error", reply.text
        assert httpx.get(live.url + "/health", headers=rebound).status_code == 403
        assert httpx.get(live.url + "/v1/models", headers={"Host": "evil.example:8080"}).status_code == 403
        for host in ("localhost", f"localhost:{live.port}", f"127.0.0.1:{live.port}", "[::1]", f"[::1]:{live.port}"):
            reply = post(live, "/v1/chat/completions", CHAT, headers={"Host": host, "Origin": f"http://{host}", **JSON})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"], host
    with LiveServer(model, tokenizer, allow_hosts=["evil.example"]) as live:  # the user named it: served
        assert post(live, "/v1/chat/completions", CHAT, headers=rebound).status_code == 200
        reply = post(live, "/v1/chat/completions", CHAT, headers={**rebound, "Host": "other.example"})
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "host_not_allowed"


# -- the queue -------------------------------------------------------------------------------
def test_a_full_queue_answers_503_or_529_with_retry_after(model, tokenizer):
    target = GatedTarget(model)
    with LiveServer(target, tokenizer, config=EngineConfig(max_queue=1)) as live:
        target.reset(hold_at=1)
        replies: list[httpx.Response] = []
        first = threading.Thread(target=lambda: replies.append(post(live, "/v1/chat/completions", CHAT)))
        first.start()
        assert target.holding.wait(30)  # the worker is busy with the first request
        second = threading.Thread(target=lambda: replies.append(post(live, "/v1/chat/completions", CHAT)))
        second.start()
        deadline = time.monotonic() + 30
        while live.engine.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            full = post(live, "/v1/chat/completions", CHAT)
            assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1
            assert full.json()["error"]["type"] == "server_error"
            full = post(live, "/v1/messages", MESSAGE)
            assert full.status_code == 529 and full.headers["retry-after"]
            assert full.json()["error"]["type"] == "overloaded_error"
        finally:
            target.gate.set()
            first.join(60)
            second.join(60)
        assert [r.status_code for r in replies] == [200, 200]
        assert post(live, "/v1/chat/completions", CHAT).status_code == 200


# -- keep-alives -------------------------------------------------------------------------------
def test_with_keepalive_comments_while_the_source_is_quiet():
    async def slow():
        yield "data: 1\n\n"
        await asyncio.sleep(0.35)
        yield "data: 2\n\n"

    async def collect():
        return [item async for item in with_keepalive(slow(), 0.1)]

    items = asyncio.run(collect())
    assert items[0] == "data: 1\n\n" and items[-1] == "data: 2\n\n"
    assert 2 <= items.count(KEEPALIVE) <= 4 and len(items) == items.count(KEEPALIVE) + 2


def test_streams_send_keepalives_during_a_slow_prefill(gated, model, tokenizer):
    live, target = gated
    messages = [{"role": "user", "content": "Keep the line open."}]
    expected = reference_text(model, tokenizer, prompt_of(tokenizer, messages), 8)
    for route, body in (("/v1/chat/completions", dict(CHAT, messages=messages, max_tokens=8, stream=True)),
                        ("/v1/messages", dict(MESSAGE, messages=messages, max_tokens=8, stream=True))):
        live.engine.prompt_cache.clear()
        target.reset(hold_at=1)
        threading.Timer(1.0, target.gate.set).start()  # the prefill takes a second
        with httpx.stream("POST", live.url + route, content=json.dumps(body), headers=JSON, timeout=60) as reply:
            lines = list(reply.iter_lines())
        assert lines.count(KEEPALIVE.strip()) >= 2, (route, lines[:8])
        datas = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        if route == "/v1/messages":
            text = "".join(d["delta"].get("text", "") for d in datas if d["type"] == "content_block_delta")
        else:
            text = "".join(d["choices"][0]["delta"].get("content") or "" for d in datas if d.get("choices"))
        assert text == expected
    # The SDKs read past the comments.
    live.engine.prompt_cache.clear()
    target.reset(hold_at=1)
    threading.Timer(0.7, target.gate.set).start()
    client = openai_client(live)
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    live.engine.prompt_cache.clear()
    target.reset(hold_at=1)
    threading.Timer(0.7, target.gate.set).start()
    claude = anthropic_client(live)
    with claude.messages.stream(model=MODEL_ID, max_tokens=8, messages=messages) as events:
        assert events.get_final_message().content[0].text == expected


# -- cancellation between prefill chunks ------------------------------------------------------------
def test_a_cancelled_prefill_stops_at_the_next_chunk_and_keeps_what_it_fed(gated, model, tokenizer, monkeypatch):
    live, target = gated
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 32)
    prompt = [4 + (i * 7) % 90 for i in range(300)]  # ten chunks
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8}
    live.engine.prompt_cache.clear()
    target.reset(hold_at=2)
    outcome: list[BaseException] = []

    def give_up() -> None:
        try:
            httpx.post(live.url + "/v1/completions", json=body, timeout=1.0)
        except httpx.ReadTimeout as e:
            outcome.append(e)

    client = threading.Thread(target=give_up)
    client.start()
    try:
        assert target.holding.wait(30)
        client.join(30)  # the client gave up and hung up
        wait_cancelled(live, "the disconnect never cancelled the request")
    finally:
        target.gate.set()
    assert live.wait_idle() and outcome  # the client timed out
    assert target.fed == [32, 32]  # the chunks after the held one never ran
    # The two chunks it fed are kept: the same prompt asked again starts from them, and equals a cold run.
    target.reset()
    reply = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert target.fed[:8] == [32] * 7 + [300 - 64 - 32 * 7]  # the rest, chunk by chunk
    out = greedy_reference(model, prompt, 8)
    assert reply["choices"][0]["text"] == tokenizer.decode(out[: out.index(EOS_ID)] if EOS_ID in out else out)


def test_health_and_the_log_show_a_long_prefills_progress(gated, monkeypatch, caplog):
    live, target = gated
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 32)
    monkeypatch.setattr(prefill_progress, "LOG_TOKENS", 100)  # a "long" prompt
    monkeypatch.setattr(prefill_progress, "LOG_SECONDS", 0.0)  # a line after every chunk
    prompt = [4 + (i * 7) % 90 for i in range(300)]  # ten chunks
    live.engine.prompt_cache.clear()
    target.reset(hold_at=3)  # held in its third chunk: two are fed
    assert httpx.get(live.url + "/health").json()["prefill"] == []
    replies: list[httpx.Response] = []
    client = threading.Thread(target=lambda: replies.append(
        post(live, "/v1/completions", {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4})))
    with caplog.at_level(logging.INFO, logger="mlx_dflash"):
        client.start()
        try:
            assert target.holding.wait(30)
            time.sleep(0.1)
            held = httpx.get(live.url + "/health").json()["prefill"]
        finally:
            target.gate.set()
        client.join(60)
    assert len(held) == 1 and held[0]["seconds"] >= 0.1
    assert held == [{"fed": 64, "total": 300, "seconds": held[0]["seconds"]}]
    assert replies[0].status_code == 200 and httpx.get(live.url + "/health").json()["prefill"] == []
    logged = [re.fullmatch(r"mlx-dflash serve: prefill (\d+)/300 tokens, [\d.]+ s", r.getMessage())
              for r in caplog.records if "prefill" in r.getMessage()]
    assert all(logged) and [int(m.group(1)) for m in logged] == [*range(32, 300, 32), 300]


def test_a_stream_dropped_during_the_prefill_is_noticed_at_a_keepalive(gated, monkeypatch):
    live, target = gated
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 32)
    live.engine.prompt_cache.clear()
    target.reset(hold_at=2)
    body = dict(CHAT, messages=[{"role": "user", "content": "x" * 300}], max_tokens=8, stream=True)
    try:
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()  # kept: a dropped iterator closes the connection at once
            assert next(lines).startswith("data: ")  # the role chunk
            assert target.holding.wait(30)  # the prefill's second chunk runs; then the client hangs up
        wait_cancelled(live, "the hang-up never cancelled the request")
    finally:
        target.gate.set()
    assert live.wait_idle()
    assert target.fed == [32, 32]


@contextlib.contextmanager
def raw_post(live, route: str, body: dict):
    """A POST of `body` on a plain socket, which the block closes without reading a byte of the reply."""
    data = json.dumps(body).encode()
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as s:
        s.sendall(head.encode() + data)
        yield s


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_client_gone_while_its_prompt_is_rendered_is_never_run(gated, monkeypatch):
    live, target = gated
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 32)
    live.engine.prompt_cache.clear()
    target.reset()
    render, entered, release = live.state.render, threading.Event(), threading.Event()

    def held_render(*args, **kwargs):
        entered.set()
        release.wait(10)  # bounded: a render on the event loop would hold the server that long
        return render(*args, **kwargs)

    monkeypatch.setattr(live.state, "render", held_render)
    submit, submitted = live.engine.submit, []
    monkeypatch.setattr(live.engine, "submit", lambda *args: submitted.append(args) or submit(*args))
    body = dict(CHAT, messages=[{"role": "user", "content": "x" * 300}], max_tokens=8, stream=True)
    try:
        with raw_post(live, "/v1/chat/completions", body):
            assert entered.wait(30)
        # The server sees the hang-up while the prompt renders (unless a render blocks its event loop).
        wait_until(lambda: not live.server.server_state.connections, 5)
    finally:
        release.set()
    assert wait_until(lambda: not live.server.server_state.tasks, 30), "the request never ended"
    assert live.wait_idle()
    assert submitted == [] and target.fed == []  # never submitted: not one prefill chunk ran


def test_a_stream_dropped_before_its_first_event_stops_its_prefill_at_the_next_chunk(gated, monkeypatch):
    live, target = gated
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 32)
    live.engine.prompt_cache.clear()
    target.reset(hold_at=1)
    prompt = [4 + (i * 5) % 90 for i in range(300)]  # ten chunks
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "stream": True}  # no event before a token
    try:
        with raw_post(live, "/v1/completions", body):
            assert target.holding.wait(30)  # the first prefill chunk runs; the client hangs up
        wait_cancelled(live, "the hang-up never cancelled the request")
    finally:
        target.gate.set()
    assert live.wait_idle()
    assert target.fed == [32]


def test_a_stream_ended_before_its_events_begin_still_cancels_its_job(gated, monkeypatch):
    """The response, not only the event generator, cancels the job: a client gone before the stream's
    generator reached the job (here: held before it starts) leaves no job running unread."""
    live, target = gated
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 32)
    live.engine.prompt_cache.clear()
    target.reset(hold_at=1)
    stream = openai_api.stream

    async def late(*args):
        await asyncio.sleep(60)  # cancelled when the client goes: the job's own events never start
        async for event in stream(*args):
            yield event

    monkeypatch.setattr(openai_api, "stream", late)
    body = {"model": MODEL_ID, "prompt": [4 + (i * 3) % 90 for i in range(300)], "max_tokens": 8, "stream": True}
    try:
        with raw_post(live, "/v1/completions", body):
            assert target.holding.wait(30)
        wait_cancelled(live, "the ended response never cancelled its job", timeout=10)
    finally:
        target.gate.set()
    assert live.wait_idle()
    assert target.fed == [32]


# -- failed requests and regenerated replies keep the cache -------------------------------------------
@contextlib.contextmanager
def second_turn(family: str, seed: int, tokenizer):
    """A live server over `family`'s tiny model (gated, with a drafter) after a first turn: yields
    (model, target, live, client, the conversation with a second question, its prompt)."""
    model = build(family, seed=seed)
    target = GatedTarget(model)
    with LiveServer(target, tokenizer, tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])) as live:
        client = openai_client(live)
        first = [{"role": "user", "content": f"Tell me about {family} caches."}]
        one = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=10)
        second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                          {"role": "user", "content": "And then?"}]
        yield model, target, live, client, second, prompt_of(tokenizer, second)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3_text"])  # attention, hybrid, sliding window
def test_a_failed_request_keeps_the_conversation_cached(family, tokenizer):
    with second_turn(family, 3, tokenizer) as (model, target, live, client, second, prompt):
        target.reset(fail_at=4)  # mid-decode, after the prefill (one or two forwards) and a cycle
        failed = httpx.post(live.url + "/v1/chat/completions", json=dict(CHAT, messages=second, max_tokens=12),
                            timeout=60)
        assert failed.status_code == 500 and "injected failure" in failed.text
        assert live.wait_idle()
        target.reset()
        again = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=12)
        # Everything but the last positions of the prompt came from the cache, and the reply is the cold run's.
        assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 2
        assert again.choices[0].message.content == reference_text(model, tokenizer, prompt, 12)


def test_a_failure_during_the_prefill_keeps_the_earlier_turns(model, tokenizer, monkeypatch):
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 8)
    target = GatedTarget(model)
    with LiveServer(target, tokenizer, tiny_drafter(model, block_size=6)) as live:
        client = openai_client(live)
        first = [{"role": "user", "content": "Tell me about caches."}]
        one = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=10)
        turn_one = one.usage.prompt_tokens + one.usage.completion_tokens
        second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                          {"role": "user", "content": "And what happens after that, in some detail?"}]
        target.reset(fail_at=2)  # the second prefill chunk
        assert httpx.post(live.url + "/v1/chat/completions", json=dict(CHAT, messages=second, max_tokens=12),
                          timeout=60).status_code == 500
        assert live.wait_idle()
        target.reset()
        again = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=12)
        assert again.usage.prompt_tokens_details.cached_tokens >= turn_one - 2
        assert again.choices[0].message.content == reference_text(model, tokenizer, prompt_of(tokenizer, second), 12)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3_text"])
def test_a_regenerated_reply_reuses_the_cached_prompt(family, tokenizer):
    with second_turn(family, 4, tokenizer) as (model, target, live, client, second, prompt):
        reply = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=12)
        for _ in range(2):  # regenerated twice: each time only the prompt's last two positions are computed
            target.reset()
            again = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=12)
            assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 2
            assert target.fed[0] == 2
            assert again.choices[0].message.content == reply.choices[0].message.content
        assert reply.choices[0].message.content == reference_text(model, tokenizer, prompt, 12)


def test_health_reads_a_running_byte_total():
    from mlx_lm.sample_utils import make_sampler

    target = TargetModel(build("qwen3", seed=5))
    sessions = []
    for i in range(4):
        s = DecodingSession(target)
        s.extend([10 + i] + list(range(20, 40)), make_sampler(0.0))
        sessions.append(s)
    size = session_bytes(sessions[0])
    cache = PromptCache(2 * size, lambda: DecodingSession(target))
    for s in sessions:
        cache.store(s)
        assert cache.nbytes == sum(n for _, n in cache._entries.values()) <= 2 * size
    cache.fetch(sessions[-1].tokens + [50, 51])  # taken over: out of the cache
    assert len(cache) == 1 and cache.nbytes == size


# -- model names, the context, max_tokens --------------------------------------------------------
def test_model_names_are_lenient_unless_strict(model, tokenizer):
    with LiveServer(model, tokenizer) as live:
        reply = post(live, "/v1/chat/completions", dict(CHAT, model="gpt-4o"))
        assert reply.status_code == 200 and reply.json()["model"] == MODEL_ID
        reply = post(live, "/v1/messages", dict(MESSAGE, model="claude-sonnet-4-5"))
        assert reply.status_code == 200 and reply.json()["model"] == MODEL_ID
        assert httpx.get(live.url + "/v1/models/gpt-4o").json()["id"] == MODEL_ID
    with LiveServer(model, tokenizer, strict_model_name=True) as live:
        reply = post(live, "/v1/chat/completions", dict(CHAT, model="gpt-4o"))
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        assert post(live, "/v1/messages", dict(MESSAGE, model="claude-x")).json()["error"]["type"] == "not_found_error"
        assert httpx.get(live.url + "/v1/models/gpt-4o").status_code == 404
        assert post(live, "/v1/chat/completions", CHAT).status_code == 200


def test_too_long_prompts_name_both_numbers_in_each_apis_words(gated, tokenizer):
    live, _ = gated
    long = [{"role": "user", "content": "z" * 5000}]
    n = len(prompt_of(tokenizer, long))
    reply = post(live, "/v1/chat/completions", dict(CHAT, messages=long))
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "4096" in error["message"] and str(n) in error["message"]
    reply = post(live, "/v1/messages", dict(MESSAGE, messages=long))
    assert reply.status_code == 400
    assert reply.json()["error"] == {"type": "invalid_request_error",
                                     "message": f"prompt is too long: {n} tokens > 4095 maximum"}


def test_a_reply_cut_by_the_context_window_says_so_on_messages(gated, tokenizer):
    live, _ = gated
    room = 3
    base = len(prompt_of(tokenizer, [{"role": "user", "content": ""}]))
    fill = [{"role": "user", "content": "z" * (4096 - room - base)}]
    assert len(prompt_of(tokenizer, fill)) == 4096 - room
    reply = post(live, "/v1/messages", dict(MESSAGE, messages=fill, max_tokens=32000)).json()
    assert reply["usage"]["output_tokens"] == room and reply["stop_reason"] == "model_context_window_exceeded"
    reply = post(live, "/v1/messages", dict(MESSAGE, messages=fill, max_tokens=2)).json()
    assert reply["stop_reason"] == "max_tokens"  # its own budget ran out first
    with anthropic_client(live).messages.stream(model=MODEL_ID, max_tokens=32000, messages=fill) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"


def test_max_tokens_is_capped_not_refused(model, tokenizer):
    expected = reference_text(model, tokenizer, prompt_of(tokenizer, CHAT["messages"]), 3)
    assert len(expected) == 3  # one character a token, none the end of sequence: the cap ends the reply
    with LiveServer(model, tokenizer, max_tokens_cap=3) as live:
        reply = post(live, "/v1/messages", dict(MESSAGE, max_tokens=32000))
        assert reply.status_code == 200 and reply.json()["usage"]["output_tokens"] == 3
        assert reply.json()["content"][0]["text"] == expected and reply.json()["stop_reason"] == "max_tokens"
        reply = post(live, "/v1/chat/completions", dict(CHAT, max_tokens=32000))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert reply.json()["choices"][0]["message"]["content"] == expected
    with LiveServer(model, tokenizer) as live:  # without a cap: the context window bounds it
        reply = post(live, "/v1/messages", dict(MESSAGE, max_tokens=32000))
        assert reply.status_code == 200 and reply.json()["stop_reason"] == "end_turn"
        assert reply.json()["content"][0]["text"] == reference_text(model, tokenizer,
                                                                    prompt_of(tokenizer, MESSAGE["messages"]), 8)
