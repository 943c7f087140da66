"""What a request must pass before a route runs (`server.http.guard`) and what must not stall the
event loop: the JSON nesting scan's results, the `Host` check against DNS rebinding (loopback
names only while bound to loopback, --allow-host names besides), origins no longer trusted for
matching a foreign `Host`, a body that arrives too slowly (408), and /health answering while
another request's body is parsed or its prompt rendered."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import httpx
import pytest
from helpers.serverkit import LiveServer
from helpers.tiny import tiny_target, tiny_tokenizer
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mlx_dflash.server.http import guard
from mlx_dflash.server.http.guard import OriginGuard, json_depth

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}
REBINDING = {"Host": "evil.example:8080", "Origin": "http://evil.example:8080"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", seed=0)


# -- the nesting scan -----------------------------------------------------------------------------
def nesting(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


def random_json(rng: random.Random, depth: int = 0):
    """Nested arrays and objects whose strings are full of brackets, quotes and backslashes."""
    pick = rng.random()
    if depth > 6 or pick < 0.35:
        return "".join(rng.choice('[]{}"\\\\ab\u00e9\u2200:,') for _ in range(rng.randrange(8)))
    if pick < 0.45:
        return rng.choice([0, -1.5, True, None])
    if pick < 0.7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {random_json(rng, 7): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_json_depth_is_the_nesting_of_valid_json():
    rng = random.Random(0)
    for _ in range(400):
        value = random_json(rng)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
            assert json_depth(text.encode()) == nesting(value), text


def test_json_depth_carries_strings_and_escapes_across_scan_blocks(monkeypatch):
    """Bodies are scanned in blocks (bounded memory): a string, a run of backslashes or the depth
    reached may span a block's end, and the result is the same whatever the block size."""
    rng = random.Random(1)
    values = [random_json(rng) for _ in range(200)]
    texts = [json.dumps(v, ensure_ascii=False).encode() for v in values]
    texts += [b'["' + b"\\" * n + b'", [[1]]]' for n in range(0, 9, 2)]
    noise = [bytes(rng.choice(b'[]{}"\\\\ a') for _ in range(rng.randrange(40))) for _ in range(300)]
    whole = [json_depth(text) for text in noise]  # any bytes, valid JSON or not: the same in blocks as whole
    for block in (1, 2, 3, 7, 64):
        monkeypatch.setattr(guard, "_SCAN_BLOCK", block)
        for value, text in zip(values, texts, strict=False):
            assert json_depth(text) == nesting(value), (block, text)
        for n, text in zip(range(0, 9, 2), texts[len(values):], strict=True):
            assert json_depth(text) == 3, (block, n)
        assert [json_depth(text) for text in noise] == whole, block


def test_json_depth_never_undercounts_a_body_json_loads_would_parse_deep():
    deep = "[" * 200 + "]" * 200
    # UTF-16: the bytes of '∀' (U+2200) hold a quote byte; read as bytes, it would hide the nesting in a string.
    body = f'["\u2200", {deep}, "x"]'
    for encoding in ("utf-16", "utf-16-le", "utf-32-be"):
        assert json_depth(body.encode(encoding)) == 201, encoding
    # Invalid JSON counts at least what the parser could reach before it fails.
    assert json_depth(b"[" * 100 + b'\\"' + b"[" * 100) >= 100
    assert json_depth(b'["a"\\' + b"[" * 100) >= 100


# -- Host and Origin -------------------------------------------------------------------------------
def guarded_client(host: str, *, loopback: bool = True, hosts: tuple[str, ...] = (),
                   origins: tuple[str, ...] = ()) -> TestClient:
    """A one-route app behind the guard, as if bound to a loopback address (or not), asked for `host`."""

    async def ok(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/health", ok), Route("/v1/messages", ok, methods=["POST"]),
                            Route("/v1/chat/completions", ok, methods=["POST"])],
                    middleware=[Middleware(OriginGuard, allowed=origins, hosts=hosts, loopback=loopback)])
    return TestClient(app, base_url=f"http://{host}")


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "app.localhost:3000", "127.0.0.1",
                                  "127.0.0.1:8080", "127.3.2.1", "[::1]", "[::1]:8080", "LOCALHOST:1"])
def test_loopback_host_names_are_served_on_a_loopback_bind(host):
    with guarded_client(host) as client:
        assert client.get("/health").status_code == 200
        origin = "http://" + host
        assert client.post("/v1/chat/completions", headers={"Origin": origin}).status_code == 200


def test_a_rebound_name_is_refused_on_a_loopback_bind_in_each_apis_shape():
    with guarded_client("evil.example:8080") as client:
        reply = client.post("/v1/chat/completions", headers=REBINDING)
        error = reply.json()["error"]
        assert reply.status_code == 403 and error["code"] == "host_not_allowed"
        assert error["type"] == "invalid_request_error" and "--allow-host" in error["message"]  # OpenAI's type
        reply = client.post("/v1/messages", headers=REBINDING)
        assert reply.status_code == 403 and reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "permission_error"
        assert client.get("/health").status_code == 403  # health too: its reply names the model and the load
        preflight = {**REBINDING, "Access-Control-Request-Method": "POST"}
        assert client.options("/v1/chat/completions", headers=preflight).status_code == 403
    for host in ("127.0.0.1.evil.example", "localhost.evil.example", "evil.example@127.0.0.1", "[::2]", "",
                 "localhost:port"):
        with guarded_client("x") as client:
            assert client.get("/health", headers={"Host": host}).status_code == 403, host


def test_allow_host_adds_names_and_their_pages():
    with guarded_client("box.lan:8080", hosts=("box.lan", "other.lan:9")) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"Host": "other.lan"}).status_code == 200  # a port given is ignored
        assert client.get("/health", headers={"Host": "localhost:8080"}).status_code == 200
        assert client.get("/health", headers={"Host": "evil.example"}).status_code == 403
        # A page on an allowed name is this server's own site.
        assert client.post("/v1/messages", headers={"Origin": "http://box.lan:3000"}).status_code == 200
        assert client.post("/v1/messages", headers={"Origin": "http://evil.example"}).status_code == 403
    with guarded_client("anything.example", hosts=("*",)) as client:
        assert client.get("/health").status_code == 200
        # '*' turns the Host check off; it does not trust every site's pages.
        reply = client.post("/v1/messages", headers={"Origin": "http://anything.example"})
        assert reply.status_code == 403 and reply.json()["error"]["type"] == "permission_error"


def test_a_non_loopback_bind_serves_any_host_but_not_a_matching_foreign_origin():
    with guarded_client("evil.example:8080", loopback=False) as client:
        assert client.get("/health").status_code == 200  # 0.0.0.0 or a LAN address: any name reaches it
        reply = client.post("/v1/chat/completions", headers=REBINDING)  # its Origin matches Host: not enough
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "origin_not_allowed"
        assert client.post("/v1/chat/completions", headers={"Origin": "http://localhost:5173"}).status_code == 200
    with guarded_client("evil.example", loopback=False, hosts=("box.lan",)) as client:
        assert client.get("/health").status_code == 403  # names given: only those (and loopback) are served
        assert client.get("/health", headers={"Host": "box.lan"}).status_code == 200
    with guarded_client("evil.example", loopback=False, origins=("http://evil.example",)) as client:
        assert client.post("/v1/messages", headers={"Origin": "http://evil.example"}).status_code == 200


def raw_request(port: int, data: bytes, read_timeout: float = 20) -> bytes:
    """Sends `data` as is and reads until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_requests_without_a_host_header_pass(model, tokenizer):
    with LiveServer(model, tokenizer) as live:
        reply = raw_request(live.port, b"GET /health HTTP/1.0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        reply = raw_request(live.port, b"GET /health HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 403"), reply[:200]


# -- bodies that take their time ---------------------------------------------------------------------
def test_a_body_sent_too_slowly_gets_408(model, tokenizer):
    with LiveServer(model, tokenizer, body_timeout=0.5) as live:
        body = json.dumps(CHAT).encode()
        for route, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
            head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            start = time.monotonic()
            reply = raw_request(live.port, head + body[:10])  # then nothing: the server must not wait for ever
            assert time.monotonic() - start < 15
            status, _, rest = reply.partition(b"\r\n")
            assert status.startswith(b"HTTP/1.1 408"), reply[:300]
            error = json.loads(rest.split(b"\r\n\r\n", 1)[1])
            if shape == "openai":
                assert error["error"]["code"] == "request_timeout" and "--body-timeout" in error["error"]["message"]
            else:
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        reply = httpx.post(live.url + "/v1/chat/completions", json=CHAT, timeout=60)  # a prompt body is in time
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


class Held:
    """Wraps a function so that a call waits (in whatever thread runs it) until `release` is set."""

    def __init__(self, function):
        self.function = function
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(10)  # bounded: on the event loop this would stall the server for 10 s
        return self.function(*args, **kwargs)


def health_while_held(live: LiveServer, held: Held, method: str, route: str, body: dict) -> httpx.Response:
    """Sends `body` to `route` in a thread; while `held` holds its handling, /health must answer."""
    replies: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: replies.append(httpx.request(
        method, live.url + route, json=body, timeout=60)))
    sender.start()
    try:
        assert held.entered.wait(30), "the request never reached the held step"
        start = time.monotonic()
        health = httpx.get(live.url + "/health", timeout=5)
        assert health.status_code == 200 and time.monotonic() - start < 5
    finally:
        held.release.set()
        sender.join(60)
    assert replies, "the held request got no reply"
    return replies[0]


def test_health_answers_while_a_prompt_is_rendered_or_a_body_parsed(model, tokenizer, monkeypatch):
    messages = [{"role": "user", "content": "x" * (1 << 20)}]  # a 1 MiB prompt
    with LiveServer(model, tokenizer) as live:
        render = Held(live.state.render)
        monkeypatch.setattr(live.state, "render", render)
        reply = health_while_held(live, render, "POST", "/v1/messages/count_tokens",
                                  {"model": "tiny", "messages": messages})
        assert reply.status_code == 200 and reply.json()["input_tokens"] > 1 << 20
        render = Held(live.state.render.function)
        monkeypatch.setattr(live.state, "render", render)
        reply = health_while_held(live, render, "POST", "/v1/chat/completions", CHAT)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
        parse = Held(guard.parse_json_object)
        monkeypatch.setattr(guard, "parse_json_object", parse)
        reply = health_while_held(live, parse, "POST", "/v1/chat/completions", dict(CHAT, messages=messages))
        assert reply.status_code == 400 and "context length" in reply.json()["error"]["message"]


def test_health_keeps_answering_while_hostile_strings_are_sent(model, tokenizer):
    """Unterminated strings of escaped quotes: a regex that retries from every quote took time
    quadratic in their length, on the event loop."""
    stop = threading.Event()
    statuses: list[int] = []

    def send() -> None:
        for size in (1 << 15, 1 << 19):  # 64 KiB, then (unless that one took seconds: quadratic) 1 MiB
            body = b'{"model": "tiny", "messages": "' + b'\\"' * size
            start = time.monotonic()
            statuses.append(httpx.post(live.url + "/v1/chat/completions", content=body, headers=JSON,
                                       timeout=120).status_code)
            if stop.is_set() or time.monotonic() - start > 3:
                return

    with LiveServer(model, tokenizer) as live:
        sender = threading.Thread(target=send)
        answered = [time.monotonic()]  # when each /health reply came: a stalled server (or GIL) leaves a gap
        sender.start()
        try:
            while sender.is_alive():
                assert httpx.get(live.url + "/health", timeout=5).status_code == 200
                answered.append(time.monotonic())
                time.sleep(0.01)
        finally:
            stop.set()
            sender.join(120)
        assert max(b - a for a, b in zip(answered, answered[1:], strict=False)) < 3
        assert statuses == [400, 400]
