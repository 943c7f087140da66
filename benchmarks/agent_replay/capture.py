"""Record what the real coding-agent CLIs send, and derive the shape file the replay synthesizes from.

    python benchmarks/agent_replay/capture.py record --dir /tmp/agent_capture [--port 8765] [--subagent]
    python benchmarks/agent_replay/capture.py shapes --dir /tmp/agent_capture --out benchmarks/agent_replay/shapes.json

`record` is a tiny stdlib HTTP server that answers Claude Code (`HEAD /`, `/v1/messages`, also
`count_tokens`) and Codex (`/v1/responses`, `/v1/models`) with minimal valid replies, streamed when
asked, and writes every request (path, a few headers, the JSON body) to `--dir`, one file each. With
`--subagent` its first reply to a Claude Code request offering a sub-agent tool (Task/Agent) calls that
tool, so Claude Code also sends a sub-agent's request. Point the CLIs at it:

    ANTHROPIC_BASE_URL=http://127.0.0.1:8765 ANTHROPIC_API_KEY=sk-local claude -p "Explain main.py"
    CODEX_HOME=/tmp/codex-home codex exec --skip-git-repo-check "Explain main.py"   (a provider with
        base_url http://127.0.0.1:8765/v1 and wire_api "responses" in $CODEX_HOME/config.toml)

The captures hold the vendors' own prompts and tool descriptions: keep them outside the repository.
`shapes` keeps only their shape: every prose string becomes {"$text": its length in characters}
(short identifiers such as roles, types, tool and property names and enum values stay), so the file
says how long the system prompt is, how many tools there are and how large each one's schema is, and
how a first request is structured, without any of the text. Standard library only, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "user-agent", "openai-beta", "originator", "version")
# Strings under these keys are prose whatever their length; elsewhere only strings over SHORT are.
PROSE_KEYS = {"text", "description", "content", "instructions", "system", "prompt", "input", "output",
              "summary", "thinking", "signature", "user_id", "title", "arguments", "default", "examples"}
SHORT = 40
# Claude Code's first system block: a billing header whose version suffix (3 hex digits) is derived from the
# session's first user message, so it differs between sessions (kept, the suffix as a placeholder).
BILLING = re.compile(r"^(x-anthropic-billing-header: cc_version=[0-9.]+?)\.[0-9a-f]{3}(;.*)$", re.S)
SESSION_MARK = "{session3}"
IDENTIFIER = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-|[0-9a-fA-F]{16,}")  # uuids, hashes: machine- or session-specific
WORD = re.compile(r"^[a-z_-]{1,12}$")  # an enum-like value ("auto", "none"), kept even under a prose key
COUNTER = itertools.count()
LOCK = threading.Lock()


# ---- the recording server -------------------------------------------------------------------------------------


def _sse(events: list[dict]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def _subagent_call(body: dict) -> dict | None:
    """A tool_use block calling the request's sub-agent tool (Task/Agent), its required fields filled."""
    for tool in body.get("tools") or []:
        schema = tool.get("input_schema") or {}
        props = schema.get("properties") or {}
        if tool.get("name") in ("Task", "Agent") and "prompt" in props:
            args = {}
            for name in schema.get("required") or []:
                prop = props.get(name, {})
                if prop.get("enum"):
                    args[name] = prop["enum"][0]
                elif name == "subagent_type":
                    args[name] = "general-purpose"
                else:
                    args[name] = "Read main.py and say in one line what it does."
            return {"type": "tool_use", "id": "toolu_capture_1", "name": tool["name"], "input": args}
    return None


def anthropic_reply(body: dict, call: dict | None) -> tuple[bytes, str]:
    """A minimal Messages reply (text "OK", or `call`), streamed as SSE when the request asks."""
    model = body.get("model", "model")
    block = call or {"type": "text", "text": "OK"}
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    stop = "tool_use" if call else "end_turn"
    if not body.get("stream"):
        message = {"id": "msg_capture", "type": "message", "role": "assistant", "model": model, "content": [block],
                   "stop_reason": stop, "stop_sequence": None, "usage": usage}
        return json.dumps(message).encode(), "application/json"
    start = {"type": "message", "id": "msg_capture", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": dict(usage, output_tokens=0)}
    if call:
        opened = dict(call, input={})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call["input"])}
    else:
        opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": "OK"}
    return _sse([
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": opened},
        {"type": "content_block_delta", "index": 0, "delta": delta},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage},
        {"type": "message_stop"},
    ]), "text/event-stream"


def responses_reply(body: dict) -> tuple[bytes, str]:
    """A minimal Responses reply: one assistant message "OK", streamed as SSE when the request asks."""
    model = body.get("model", "model")
    part = {"type": "output_text", "text": "OK", "annotations": []}
    item = {"id": "msg_capture", "type": "message", "role": "assistant", "status": "completed", "content": [part]}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
    response = {"id": "resp_capture", "object": "response", "created_at": int(time.time()), "model": model,
                "status": "completed", "output": [item], "usage": usage, "error": None, "incomplete_details": None}
    if not body.get("stream"):
        return json.dumps(response).encode(), "application/json"
    ref = {"item_id": "msg_capture", "output_index": 0, "content_index": 0}
    events = [
        {"type": "response.created", "response": dict(response, status="in_progress", output=[], usage=None)},
        {"type": "response.output_item.added", "output_index": 0,
         "item": dict(item, status="in_progress", content=[])},
        {"type": "response.content_part.added", **ref, "part": dict(part, text="")},
        {"type": "response.output_text.delta", **ref, "delta": "OK"},
        {"type": "response.output_text.done", **ref, "text": "OK"},
        {"type": "response.content_part.done", **ref, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response},
    ]
    for n, event in enumerate(events):
        event["sequence_number"] = n
    return _sse(events), "text/event-stream"


class Recorder(BaseHTTPRequestHandler):
    """Answers the agents' requests and writes each one to the server's `out` folder."""

    server_version = "agent-capture"

    def log_message(self, fmt: str, *args) -> None:
        print(f"capture: {self.command} {self.path} -> {args[1] if len(args) > 1 else ''}", file=sys.stderr)

    def _save(self, body) -> None:
        with LOCK:
            n = next(COUNTER)
        record = {"n": n, "time": time.time(), "method": self.command, "path": self.path,
                  "headers": {k.lower(): v for k, v in self.headers.items() if k.lower() in KEPT_HEADERS},
                  "body": body}
        name = self.path.split("?")[0].strip("/").replace("/", "_") or "root"
        (self.server.out / f"{n:04d}-{self.command}-{name}.json").write_text(json.dumps(record, indent=1))

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._save(None)
        self._send(200, b"", "text/plain")

    def do_GET(self) -> None:  # noqa: N802
        self._save(None)
        if self.path.split("?")[0].rstrip("/").endswith("/models"):
            data = {"object": "list", "data": [{"id": "capture", "object": "model", "owned_by": "capture"}]}
            return self._send(200, json.dumps(data).encode(), "application/json")
        self._send(200 if self.path == "/" else 404, b"{}", "application/json")

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = {"$unparsed_bytes": len(raw)}
        self._save(body)
        path = self.path.split("?")[0]
        if path.endswith("/count_tokens"):
            return self._send(200, json.dumps({"input_tokens": len(raw) // 4}).encode(), "application/json")
        if path.endswith("/messages") and isinstance(body, dict):
            call = None
            if self.server.subagent and not self.server.called and not _has_tool_result(body):
                call = _subagent_call(body)
                self.server.called = call is not None
            return self._send(200, *anthropic_reply(body, call))
        if path.endswith("/responses") and isinstance(body, dict):
            return self._send(200, *responses_reply(body))
        self._send(404, b'{"error": "not recorded here"}', "application/json")


def _has_tool_result(body: dict) -> bool:
    return any(isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
               for m in body.get("messages") or [])


def record(out: Path, port: int, subagent: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", port), Recorder)
    server.out, server.subagent, server.called = out, subagent, False
    print(f"recording on http://127.0.0.1:{server.server_address[1]} into {out}; Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ---- the shapes -----------------------------------------------------------------------------------------------


def skeleton(value, key: str | None = None):
    """`value` with its prose replaced by {"$text": length} (strings under PROSE_KEYS, and any over SHORT chars),
    identifiers by {"$id": length}, and the billing header's per-session suffix by SESSION_MARK."""
    if isinstance(value, dict):
        return {k: skeleton(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(v, key) for v in value]
    if isinstance(value, str):
        billing = BILLING.match(value)
        if billing:
            return billing.group(1) + "." + SESSION_MARK + billing.group(2)
        if IDENTIFIER.search(value):
            return {"$id": len(value)}
        if key == "$schema" and value.startswith("http"):
            return value
        if (key in PROSE_KEYS and not WORD.match(value)) or len(value) > SHORT:
            return {"$text": len(value)}
    return value


def _text_chars(content) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def _system_chars(body: dict) -> tuple[int, int]:
    """Characters of the system prompt: (Messages' `system` or Responses' `instructions`, the text of system and
    developer messages among `messages` / `input`: Claude Code sends one after the user's, Codex sends its
    instructions as developer messages)."""
    field = _text_chars(body.get("system") or body.get("instructions") or "")
    items = [m for m in (body.get("messages") or body.get("input") or []) if isinstance(m, dict)]
    return field, sum(_text_chars(m.get("content")) for m in items if m.get("role") in ("developer", "system"))


def _tool_name(tool: dict) -> str:
    return tool.get("name") or tool.get("function", {}).get("name") or tool.get("type", "?")


def describe(body: dict) -> dict:
    """One request's shape: system prompt and tools sizes, and its skeleton."""
    tools = body.get("tools") or []
    field, messages = _system_chars(body)
    return {"system_chars": field, "system_message_chars": messages,
            "tools": [{"name": _tool_name(t), "type": t.get("type"), "chars": len(json.dumps(t))} for t in tools],
            "tools_chars": sum(len(json.dumps(t)) for t in tools),
            "skeleton": skeleton(body)}


def _system_key(body: dict) -> str:
    system = body.get("system") or body.get("instructions") or ""
    return hashlib.sha256(json.dumps(system).encode()).hexdigest()


def derive_bodies(captures: Path) -> dict[str, dict]:
    """Per agent: its API, path and headers, the main first request (the first with the most tools) and, when
    captured, a sub-agent's (the first request after it with tools, another system prompt and a fresh
    conversation), as the real bodies."""
    records = [json.loads(p.read_text()) for p in sorted(captures.glob("*.json"))]
    found: dict[str, dict] = {}
    for agent, suffix, api in (("claude-code", "/messages", "anthropic"), ("codex", "/responses", "responses")):
        posts = [r for r in records if r["method"] == "POST" and r["path"].split("?")[0].endswith(suffix)
                 and isinstance(r["body"], dict)]
        if not posts:
            continue
        most = max(len(r["body"].get("tools") or []) for r in posts)
        i = next(i for i, r in enumerate(posts) if len(r["body"].get("tools") or []) == most)
        main = posts[i]["body"]
        sub = next((r["body"] for r in posts[i + 1:] if r["body"].get("tools")
                    and _system_key(r["body"]) != _system_key(main) and len(r["body"].get("messages") or []) <= 2),
                   None)
        found[agent] = {"api": api, "path": posts[i]["path"], "headers": posts[i]["headers"], "main": main,
                        "subagent": sub, "seen": len(posts)}
    return found


def derive(captures: Path, versions: dict[str, str | None]) -> dict:
    """The shape file's content: per agent, its main first request's and its sub-agent's shapes."""
    shapes: dict[str, dict] = {}
    for agent, found in derive_bodies(captures).items():
        headers = found["headers"]
        shape = {"api": found["api"], "path": found["path"], "cli": versions.get(agent),
                 "user_agent": headers.get("user-agent"),
                 "headers": {k: v for k, v in headers.items() if k.startswith("anthropic")},
                 "requests_seen": found["seen"], **describe(found["main"])}
        if found["subagent"] is not None:
            shape["subagent"] = describe(found["subagent"])
        shapes[agent] = shape
    return shapes


def dump(value, depth: int = 0, levels: int = 3) -> str:
    """JSON indented down to `levels` deep and compact below (one line per tool), so the file stays small."""
    pad = " " * (depth + 1)
    if depth >= levels or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {dump(v, depth + 1, levels)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad[:-1] + "}"
    return "[\n" + ",\n".join(pad + dump(v, depth + 1, levels) for v in value) + "\n" + pad[:-1] + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="answer the CLIs and write their requests into --dir")
    rec.add_argument("--dir", type=Path, required=True)
    rec.add_argument("--port", type=int, default=8765)
    rec.add_argument("--subagent", action="store_true", help="call Claude Code's sub-agent tool once")
    shp = sub.add_parser("shapes", help="derive the shape file from the captures in --dir")
    shp.add_argument("--dir", type=Path, required=True)
    shp.add_argument("--out", type=Path, required=True)
    shp.add_argument("--claude-version", default=None, help="`claude --version` of the capture")
    shp.add_argument("--codex-version", default=None, help="`codex --version` of the capture")
    args = parser.parse_args()
    if args.command == "record":
        record(args.dir, args.port, args.subagent)
        return
    shapes = derive(args.dir, {"claude-code": args.claude_version, "codex": args.codex_version})
    if not shapes:
        raise SystemExit(f"no /v1/messages or /v1/responses requests in {args.dir}")
    args.out.write_text(dump(shapes) + "\n")
    for agent, s in shapes.items():
        print(f"{agent}: system {s['system_chars']} + {s['system_message_chars']} chars (field + messages), "
              f"{len(s['tools'])} tools ({s['tools_chars']} chars)"
              + (f", sub-agent system {s['subagent']['system_chars']} chars" if "subagent" in s else ""))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
