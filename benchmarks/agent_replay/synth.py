"""Requests of the agents' captured shapes: each prose string of the shape file's skeleton becomes deterministic
filler of its length (scaled for the system part), and a session's turns grow as the agent's would.

Why synthesize: the vendors' prompts may not be committed, but their sizes and structure decide what the
prompt cache sees (where the first difference between two sessions falls, how much each turn adds). The
filler is words drawn by a generator seeded with the agent and the string's place in the request, so the
system prompt and tools are identical in every session of an agent, as the real ones are, while each
session's own prompt differs. Claude Code's billing header (its first system block) carries a 3-hex suffix
that differs between sessions (derived from the request; seen in the captures): it is derived here from the
session's prompt, so a new session differs from the first system block on, as with the real CLI. A sub-agent's
filler is its own (the real one shares at most its first short system block with the main agent's).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHAPES = Path(__file__).with_name("shapes.json")
SESSION_MARK = "{session3}"
# Plain words for the filler (a fixed list: the text is the same on every machine and Python version).
WORDS = tuple("""
the a of to and in is it for on with as by this that be are from or at an not when each file if then
use your you can should must will do does make sure only any all new other more most before after
code function call return value values result results error errors change changes test tests run
command commands path paths line lines read write edit search find list output input user users tool
tools task tasks agent agents model message messages project repository branch commit review check
build install directory module class method type types string number object array field fields option
options default request response server client context prompt session state cache data text block
first last next previous always never instead without within between about into over under
current given existing following specific relevant important clear short long simple exact
""".split())
# The filler's characters per token with SmolLM2's tokenizer (measured: 50,000 characters, 9,228 tokens).
CHARS_PER_TOKEN = 5.4
PROMPTS = {  # each session's own request (its first user message)
    "A": "Explain main.py and say what greet returns.",
    "B": "Add a unit test for greet in tests/test_main.py.",
    "C": "Rename greet to welcome everywhere and update the callers.",
    "sub": "Find every caller of greet in the repository and list them with their line numbers.",
}


def filler(n: int, seed: str) -> str:
    """Exactly `n` characters of words, with a full stop now and then and a line break more rarely."""
    if n <= 0:
        return ""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS)
        roll = rng.random()
        word += ".\n" if roll < 0.02 else "." if roll < 0.1 else ""
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:n]


def session_suffix(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:3]


def fill(node: Any, seed: str, scale: float, session: str, path: str = "") -> Any:
    """The skeleton `node` made concrete: {"$text": n} -> filler of round(n * scale) characters (1 at least),
    {"$id": n} -> a hex identifier of the session, SESSION_MARK -> the session's suffix; the rest copied."""
    if isinstance(node, dict):
        if set(node) == {"$text"}:
            return filler(max(1, round(node["$text"] * scale)), f"{seed}|{path}")
        if set(node) == {"$id"}:
            return hashlib.sha256(f"{session}|{path}".encode()).hexdigest()[: node["$id"]]
        return {k: fill(v, seed, scale, session, f"{path}/{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [fill(v, seed, scale, session, f"{path}/{i}") for i, v in enumerate(node)]
    if isinstance(node, str) and SESSION_MARK in node:
        return node.replace(SESSION_MARK, session_suffix(session))
    return node


def prose_chars(node: Any) -> int:
    """Characters of the skeleton's prose ({"$text": n} nodes)."""
    if isinstance(node, dict):
        return node["$text"] if set(node) == {"$text"} else sum(prose_chars(v) for v in node.values())
    if isinstance(node, list):
        return sum(prose_chars(v) for v in node)
    return 0


def _conversation_key(api: str) -> str:
    return "messages" if api == "anthropic" else "input"


def system_part(skeleton: dict, api: str) -> dict:
    """The parts of a request that are the agent's system prompt and tools (what --system-tokens scales):
    the system field / instructions, the tools, and system or developer messages anywhere in the conversation."""
    items = skeleton.get(_conversation_key(api)) or []
    return {"system": skeleton.get("system"), "instructions": skeleton.get("instructions"),
            "tools": skeleton.get("tools"),
            "messages": [m for m in items if isinstance(m, dict) and m.get("role") in ("system", "developer")]}


def scale_for(skeleton: dict, api: str, system_tokens: int | None) -> float:
    """The factor that brings the system part's prose to about `system_tokens` tokens (at most 1; None: 1)."""
    chars = prose_chars(system_part(skeleton, api))
    if system_tokens is None or chars == 0:
        return 1.0
    return min(1.0, system_tokens * CHARS_PER_TOKEN / chars)


@dataclass
class AgentShape:
    """One agent's request shapes: its main first request and, when captured, a sub-agent's."""

    name: str
    api: str  # "anthropic" (/v1/messages) or "responses" (/v1/responses)
    path: str
    cli: str | None
    headers: dict
    skeleton: dict
    subagent: dict | None = None
    captured: bool = False  # real bodies (--capture): nothing to fill but the session's prompt and suffix
    summary: dict = field(default_factory=dict)


def load_shapes(path: Path = SHAPES) -> dict[str, AgentShape]:
    """The shape file (benchmarks/agent_replay/shapes.json by default) as AgentShapes by agent name."""
    data = json.loads(Path(path).read_text())
    out = {}
    for name, s in data.items():
        summary = {k: s.get(k) for k in ("system_chars", "system_message_chars", "tools_chars", "requests_seen")}
        summary["tools"] = len(s.get("tools") or [])
        out[name] = AgentShape(name, s["api"], s["path"], s.get("cli"), s.get("headers") or {}, s["skeleton"],
                               (s.get("subagent") or {}).get("skeleton"), summary=summary)
    return out


def _prompt_slot(body: dict, api: str) -> tuple[Any, Any] | None:
    """(container, key) of the session's own prompt: the last text part of the first user message (Messages)
    or of the last user message (Responses)."""
    items = [m for m in body.get(_conversation_key(api)) or [] if isinstance(m, dict) and m.get("role") == "user"]
    if not items:
        return None
    message = items[0] if api == "anthropic" else items[-1]
    content = message.get("content")
    if isinstance(content, str):
        return message, "content"
    texts = [p for p in content or [] if isinstance(p, dict) and "text" in p]
    return (texts[-1], "text") if texts else None


def first_request(shape: AgentShape, skeleton: dict, session: str, prompt: str, scale: float,
                  max_tokens: int) -> dict:
    """A session's first request: the skeleton filled (the system part scaled), the session's prompt in place."""
    seed = f"{shape.name}|{id_of(skeleton)}"
    body = {}
    part = system_part(skeleton, shape.api)
    for key, value in skeleton.items():
        if key in ("system", "instructions", "tools"):
            body[key] = fill(value, seed, scale, session, f"/{key}")
        elif key == _conversation_key(shape.api):
            body[key] = [fill(m, seed, scale if m in part["messages"] else 1.0, session, f"/{key}/{i}")
                         for i, m in enumerate(value)]
        else:
            body[key] = fill(value, seed, 1.0, session, f"/{key}")
    slot = _prompt_slot(body, shape.api)
    if slot is not None:
        slot[0][slot[1]] = prompt
    body["stream"] = True
    if shape.api == "anthropic":
        body["max_tokens"] = max_tokens
    else:
        body["max_output_tokens"] = max_tokens
    return body


def id_of(skeleton: dict) -> str:
    """A short stable name of a skeleton, so a sub-agent's filler is its own."""
    return hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode()).hexdigest()[:8]


def _call_args(schema: dict, turn: int) -> dict:
    """Short values for a tool's required string arguments."""
    props = schema.get("properties") or {}
    args = {}
    for name in schema.get("required") or list(props)[:1]:
        kind = props.get(name, {}).get("type")
        if kind in (None, "string"):
            args[name] = f"src/module_{turn}.py" if "path" in name or "file" in name else f"cat src/module_{turn}.py"
        elif kind in ("integer", "number"):
            args[name] = turn
        elif kind == "boolean":
            args[name] = False
    return args


def pick_tool(body: dict) -> tuple[str, dict]:
    """The tool a turn calls: Read, Bash or exec_command when offered (what agents call most), else the first."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and (t.get("name") or t.get("function"))]
    for preferred in ("Read", "Bash", "exec_command", "shell"):
        for t in tools:
            if t.get("name") == preferred:
                return preferred, t.get("input_schema") or t.get("parameters") or {}
    if tools:
        t = tools[0]
        return t.get("name", "tool"), t.get("input_schema") or t.get("parameters") or {}
    return "Read", {"required": ["file_path"], "properties": {"file_path": {"type": "string"}}}


def next_turn(body: dict, api: str, reply: dict, session: str, turn: int, result_tokens: int) -> dict:
    """The request after `reply`: the assistant's reply as returned (blocks / output items), a call of a tool
    when the reply made none (an agent's turn always ends in one here), and that tool's result of about
    `result_tokens` tokens."""
    body = copy.deepcopy(body)
    name, schema = pick_tool(body)
    call_id = f"call_{session}_{turn}"
    result = filler(round(result_tokens * CHARS_PER_TOKEN), f"result|{session}|{turn}")
    if api == "anthropic":
        blocks = [b for b in reply.get("blocks") or [] if not (b.get("type") == "text" and not b.get("text"))]
        calls = [b for b in blocks if b.get("type") == "tool_use"]
        if not calls:
            calls = [{"type": "tool_use", "id": call_id, "name": name, "input": _call_args(schema, turn)}]
            blocks.append(calls[0])
        for m in body["messages"]:  # Claude Code marks only the newest block for caching
            if isinstance(m.get("content"), list):
                for b in m["content"]:
                    b.pop("cache_control", None)
        body["messages"].append({"role": "assistant", "content": blocks})
        results = [{"type": "tool_result", "tool_use_id": c["id"], "content": result} for c in calls]
        results[-1]["cache_control"] = {"type": "ephemeral"}
        body["messages"].append({"role": "user", "content": results})
    else:
        items = list(reply.get("items") or [])
        calls = [i for i in items if i.get("type") in ("function_call", "custom_tool_call")]
        if not calls:
            calls = [{"type": "function_call", "name": name, "arguments": json.dumps(_call_args(schema, turn)),
                      "call_id": call_id}]
            items.extend(calls)
        body["input"].extend(items)
        for c in calls:
            kind = "custom_tool_call_output" if c["type"] == "custom_tool_call" else "function_call_output"
            body["input"].append({"type": kind, "call_id": c["call_id"], "output": result})
    return body


def templated(body: dict) -> dict:
    """A captured body as a skeleton without prose nodes: only the billing header's suffix made per-session
    (the real CLI computes it per session), so `fill` leaves the rest as it is."""
    from .capture import BILLING  # the same pattern as the shape file's

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            match = BILLING.match(node)
            if match:
                return match.group(1) + "." + SESSION_MARK + match.group(2)
        return node

    return walk(body)


def load_captured(directory: Path) -> dict[str, AgentShape]:
    """Shapes from real captured bodies (capture.py record): the same choice of main and sub-agent request as
    the shape file's, the bodies used as they are (no filler, no scaling)."""
    from .capture import derive_bodies

    out = {}
    for name, found in derive_bodies(Path(directory)).items():
        main, sub = found["main"], found["subagent"]
        headers = {k: v for k, v in found["headers"].items() if k.startswith("anthropic")}
        out[name] = AgentShape(name, found["api"], found["path"], found["headers"].get("user-agent"), headers,
                               templated(main), templated(sub) if sub else None, captured=True,
                               summary={"tools": len(main.get("tools") or []), "captured": str(directory)})
    return out
