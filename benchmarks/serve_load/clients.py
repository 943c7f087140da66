"""The run's ordinary clients: streamed conversations (follow-ups included), streams closed mid-way, requests
hung up on at once, and the /health poller; each request has a time-out, so the run is bounded."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import httpx

from .hostile import hostile_client, raw_request
from .prompts import pick_conversation
from .record import MODEL_ID, Run

HEADERS = {"anthropic-version": "2023-06-01"}


def request_body(api: str, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    if api == "openai":
        return "/v1/chat/completions", {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens,
                                        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    return "/v1/messages", {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True}


def sse_lines(response: httpx.Response):
    """The stream's lines, split at "\n" only (a reply's text may hold U+2028 or U+0085, which
    `str.splitlines` would split at)."""
    buffer = b""
    for chunk in response.iter_bytes():
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buffer:
        yield buffer.decode("utf-8", "replace")


def stream_turn(run: Run, client: httpx.Client, api: str, messages: list[dict], stop_after: int | None = None) -> dict:
    """One streamed request; `stop_after`: close the stream after that many events. Returns what happened:
    outcome (completed, cancelled, timeout, cut, status, stream_error, transport), text, cached and prompt tokens."""
    path, body = request_body(api, messages, run.args.max_tokens)
    out = {"api": api, "outcome": "transport", "text": "", "cached": None, "prompt_tokens": None,
           "start": time.time(), "first": None, "end": None}
    deadline = run.deadline()
    text: list[str] = []
    events = 0
    timeout = httpx.Timeout(run.args.read_timeout, connect=10.0)
    try:
        with client.stream("POST", run.url + path, json=body, headers=HEADERS, timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                out["outcome"], out["status"] = "status", response.status_code
                out["detail"] = response.text[:300]
                return out
            for line in sse_lines(response):
                if time.time() > deadline:
                    out["outcome"] = "cut" if deadline >= run.cut else "timeout"
                    return out
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    data = json.loads(line[6:])
                except ValueError:
                    out["outcome"], out["detail"] = "stream_error", f"an event that is not JSON: {line[:200]!r}"
                    return out
                out["first"] = out["first"] or time.time()
                events += 1
                if "error" in data or data.get("type") == "error":
                    out["outcome"], out["detail"] = "stream_error", json.dumps(data)[:300]
                    return out
                if api == "openai":
                    if data.get("choices") and data["choices"][0].get("delta", {}).get("content"):
                        text.append(data["choices"][0]["delta"]["content"])
                    if data.get("usage"):
                        out["prompt_tokens"] = data["usage"]["prompt_tokens"]
                        out["cached"] = data["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if data.get("choices") and data["choices"][0].get("finish_reason"):
                        out["outcome"] = "completed"  # the usage chunk and [DONE] may follow
                else:
                    kind = data.get("type")
                    if kind == "content_block_delta" and data["delta"].get("type") == "text_delta":
                        text.append(data["delta"]["text"])
                    elif kind == "message_delta":
                        usage = data["usage"]
                        out["cached"] = usage["cache_read_input_tokens"]
                        out["prompt_tokens"] = usage["input_tokens"] + usage["cache_read_input_tokens"]
                    elif kind == "message_stop":
                        out["outcome"] = "completed"
                if stop_after is not None and events >= stop_after and out["outcome"] != "completed":
                    out["outcome"] = "cancelled"
                    return out  # leaving the block closes the connection mid-stream
            if out["outcome"] != "completed":
                out["outcome"], out["detail"] = "stream_error", "the stream ended without its last event"
    except httpx.TimeoutException:
        out["outcome"] = "cut" if time.time() >= run.cut else "timeout"
    except httpx.HTTPError as e:
        out["outcome"], out["detail"] = "transport", f"{type(e).__name__}: {e}"
    finally:
        out["end"] = time.time()
        out["text"] = "".join(text)
    return out


def note(run: Run, result: dict, purpose: str) -> None:
    """File one normal request's outcome."""
    rec, api, outcome = run.record, result["api"], result["outcome"]
    if outcome == "completed":
        rec.count("served", api)
    elif outcome == "cancelled":
        rec.count("cancelled")
    elif outcome == "cut":
        rec.count("cut_at_end")
    elif outcome == "timeout":
        rec.count("timeouts", api)
    elif outcome == "stream_error":
        rec.add("stream_errors", f"{api} {purpose}: {result.get('detail')}")
    elif outcome == "status" and result["status"] >= 500:
        rec.add("five_xx", f"{api} {purpose}: {result['status']} {result.get('detail')}")
    else:
        rec.add("unexpected", f"{api} {purpose}: {outcome} {result.get('status', '')} {result.get('detail', '')}")


def conversation(run: Run, client: httpx.Client, rng: random.Random) -> None:
    api = rng.choice(["openai", "anthropic"])
    messages: list[dict] = []
    previous = None
    for turn, user in enumerate(pick_conversation(run.prompts, rng)):
        if run.over():
            return
        messages.append({"role": "user", "content": user})
        result = stream_turn(run, client, api, messages)
        note(run, result, f"turn {turn + 1}")
        if result["outcome"] != "completed":
            return
        if previous is not None:
            run.record.add("follow_ups", {"api": api, "turn": turn + 1, "cached": result["cached"],
                                          "prompt_tokens": result["prompt_tokens"],
                                          "previous_prompt_tokens": previous["prompt_tokens"],
                                          "previous_end": previous["end"], "start": result["start"],
                                          "end": result["end"]})
        messages.append({"role": "assistant", "content": result["text"]})
        previous = result


def cancel_mid_stream(run: Run, client: httpx.Client, rng: random.Random) -> None:
    api = rng.choice(["openai", "anthropic"])
    turns = pick_conversation(run.prompts, rng)
    result = stream_turn(run, client, api, [{"role": "user", "content": turns[0]}],
                         stop_after=rng.randint(1, max(run.args.max_tokens // 2, 2)))
    note(run, result, "cancelled stream")


def hang_up(run: Run, rng: random.Random) -> None:
    """Send a streamed request on a raw socket and close it before any answer."""
    api = rng.choice(["openai", "anthropic"])
    path, body = request_body(api, [{"role": "user", "content": pick_conversation(run.prompts, rng)[0]}],
                              run.args.max_tokens)
    try:
        with socket.create_connection(("127.0.0.1", run.port), timeout=10) as sock:
            sock.sendall(raw_request(run.port, "POST", path, json.dumps(body).encode()))
        run.record.count("hangups")
    except OSError as e:
        run.record.add("unexpected", f"hang-up {api}: {type(e).__name__}: {e}")
    time.sleep(rng.uniform(0.2, 1.0))  # the next action follows after a human-sized pause


def mixed_client(run: Run, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client() as client:
        while not run.over():
            action = rng.choices(["conversation", "cancel", "hangup"], [6, 3, 1])[0]
            try:
                if action == "conversation":
                    conversation(run, client, rng)
                elif action == "cancel":
                    cancel_mid_stream(run, client, rng)
                else:
                    hang_up(run, rng)
            except Exception as e:  # noqa: BLE001 - a client bug must not end the run silently
                run.record.add("unexpected", f"{action}: client error {type(e).__name__}: {e}")


def health_poller(run: Run) -> None:
    rec = run.record
    with httpx.Client(timeout=run.args.health_timeout) as client:
        while not run.clients_done.is_set():
            start = time.perf_counter()
            try:
                response = client.get(run.url + "/health")
                seconds = time.perf_counter() - start
                if response.status_code != 200:
                    rec.add("health_failures", (time.time(), f"status {response.status_code}"))
                    if response.status_code >= 500:
                        rec.add("five_xx", f"/health: {response.status_code}")
                else:
                    rec.add("health", seconds)
                    data = response.json()
                    rec.add("health_samples", (time.time(), data["prompt_cache"]["bytes"], data["waiting"]))
            except httpx.HTTPError as e:
                seconds = time.perf_counter() - start
                rec.add("health_failures", (time.time(), type(e).__name__))
            time.sleep(max(run.args.health_interval - seconds, 0.0))


def warm_up(url: str) -> None:
    """One short request before the clock starts (first allocations, kernel set-up); not counted."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    try:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        print(f"warm-up request failed: {type(e).__name__}: {e}", flush=True)


def wait_idle(url: str, timeout: float) -> float | None:
    """Seconds until /health says nothing runs or waits (None: not within `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            data = httpx.get(url + "/health", timeout=5).json()
            if not data["busy"] and data["waiting"] == 0:
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return None


def run_clients(run: Run) -> None:
    """The hostile prober (with two clients or more), the mixed clients and the /health poller, until
    the run's end; a client still running well past it is reported, not waited for."""
    args = run.args
    clients = []
    for i in range(args.clients):
        role = hostile_client if i == 0 and args.clients > 1 else mixed_client
        clients.append(threading.Thread(target=role, args=(run, args.seed * 1000 + i), daemon=True,
                                        name=f"{role.__name__}-{i}"))
    poller = threading.Thread(target=health_poller, args=(run,), daemon=True)
    poller.start()
    for t in clients:
        t.start()
    limit = run.cut + max(args.read_timeout, args.hostile_timeout) + 15
    for t in clients:
        t.join(max(limit - time.time(), 0.1))
    stuck = [t.name for t in clients if t.is_alive()]
    if stuck:
        run.record.add("unexpected", f"clients still running past the run's bound: {stuck}")
    run.clients_done.set()
    poller.join(args.health_timeout + 1)
