"""The hostile prober: malformed, oversized and foreign-Host requests, each sent on a raw socket (so that
nothing fixes them on the way), each to be answered 4xx within --hostile-timeout."""

from __future__ import annotations

import json
import random
import select
import socket
import time
from collections import Counter

from .record import MODEL_ID, Run

FOREIGN_HOST = "evil.example:8080"


def raw_request(port: int, method: str, path: str, body: bytes, headers: dict | None = None,
                content_type: str = "application/json") -> bytes:
    """An HTTP/1.1 request's bytes, as sent (`headers` replace the usual ones)."""
    head = {"Host": f"127.0.0.1:{port}", "Content-Type": content_type, "Content-Length": str(len(body)),
            "anthropic-version": "2023-06-01", **(headers or {})}
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    return "\r\n".join(lines).encode() + body


def _chat(content: str = "hi", **more) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **more}


WRONG_TYPES = [
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": "hello"}),
    ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", _chat(max_tokens="many")),
    ("/v1/chat/completions", _chat(temperature=[1])),
    ("/v1/chat/completions", _chat(stream="yes")),
    ("/v1/messages", {"model": MODEL_ID, "max_tokens": "64", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"model": MODEL_ID, "max_tokens": 8, "messages": {"role": "user"}}),
    ("/v1/chat/completions", [1, 2, 3]),
]


def exchange(port: int, head: bytes, chunks, timeout: float) -> int | str:
    """Send `head` then `chunks` on a raw socket, stopping as soon as an answer comes; the answer's
    status, or why there is none ('timeout', 'reset', 'closed')."""
    deadline = time.monotonic() + timeout
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.settimeout(2.0)
        try:
            sock.sendall(head)
            if chunks is not None and not select.select([sock], [], [], 0.5)[0]:  # no answer to the headers alone
                for chunk in chunks:
                    if time.monotonic() > deadline:
                        return "timeout"
                    if select.select([sock], [], [], 0)[0]:
                        break
                    sock.sendall(chunk)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading (it answered, or it is stuck): read what it says
        while b"\r\n" not in answer:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return "timeout"
            except ConnectionResetError:
                return "reset"
            if not data:
                return "closed"
            answer += data
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "garbled"


def hostile_cases(port: int, max_body: int, rng: random.Random) -> dict:
    """Each case: a function(timeout) -> status (int) or the reason for none."""
    big = b" " * (64 << 10)
    extra = max_body // len(big) + 2  # one chunk past the limit, whatever it is

    def body_case(path: str, raw: bytes, content_type: str = "application/json", headers: dict | None = None):
        def send(timeout: float) -> int | str:
            return exchange(port, raw_request(port, "POST", path, raw, headers, content_type), None, timeout)
        return send

    def wrong_types(timeout: float) -> int | str:
        path, body = rng.choice(WRONG_TYPES)
        return exchange(port, raw_request(port, "POST", path, json.dumps(body).encode()), None, timeout)

    def oversized_declared(timeout: float) -> int | str:
        head = raw_request(port, "POST", "/v1/chat/completions", b"")
        head = head.replace(b"Content-Length: 0", f"Content-Length: {len(big) * extra}".encode())
        return exchange(port, head, (big for _ in range(extra)), timeout)

    def oversized_chunked(timeout: float) -> int | str:
        head = raw_request(port, "POST", "/v1/chat/completions", b"").replace(
            b"Content-Length: 0", b"Transfer-Encoding: chunked")
        frames = (b"%x\r\n%s\r\n" % (len(big), big) for _ in range(extra))
        return exchange(port, head, _then_end(frames), timeout)

    nested = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    # The first round goes in this order: the cases a slow parse could hold the server with come last.
    return {
        "wrong types": wrong_types,
        "wrong content type": body_case("/v1/chat/completions", json.dumps(_chat()).encode(), "text/plain"),
        "foreign Host and Origin": body_case("/v1/chat/completions", json.dumps(_chat()).encode(),
                                             headers={"Host": FOREIGN_HOST, "Origin": f"http://{FOREIGN_HOST}"}),
        "oversized, declared length": oversized_declared,
        "oversized, chunked": oversized_chunked,
        "deep nesting (100k)": body_case("/v1/chat/completions", nested),
        "unterminated escaped quotes": body_case("/v1/chat/completions", b'"' + b'\\"' * 100_000),
    }


def _then_end(frames):
    yield from frames
    yield b"0\r\n\r\n"


def hostile_client(run: Run, seed: int) -> None:
    rng = random.Random(seed)
    cases = hostile_cases(run.port, run.server["max_body_bytes"], rng)
    cases = {name: send for name, send in cases.items() if not any(s in name for s in run.args.skip_hostile)}
    with run.record.lock:
        for name in cases:
            run.record.hostile[name] = {"sent": 0, "4xx": 0, "other": Counter(), "latencies": [], "quarantined": False,
                                        "timeouts": []}
    first = True
    while not run.over():
        names = [n for n in cases if not run.record.hostile[n]["quarantined"]]
        if not names:
            return
        if not first:
            rng.shuffle(names)
        first = False
        for name in names:
            if run.over():
                return
            start, sent_at = time.perf_counter(), time.time()
            try:
                status = cases[name](run.args.hostile_timeout)
            except OSError as e:
                status = f"{type(e).__name__}"
            seconds = time.perf_counter() - start
            with run.record.lock:
                case = run.record.hostile[name]
                case["sent"] += 1
                case["latencies"].append(seconds)
                if isinstance(status, int) and 400 <= status < 500:
                    case["4xx"] += 1
                else:
                    case["other"][str(status)] += 1
                    if isinstance(status, int) and status >= 500:
                        run.record.five_xx.append(f"hostile {name}: {status}")
                if status == "timeout":
                    case["quarantined"] = True  # it may hold the server: sent once, reported
                    case["timeouts"].append((sent_at, time.time()))
            time.sleep(run.args.hostile_interval)
