"""The agent replay's pure parts: the shape file and its skeletons, the synthesized requests and turns, the
recording server and the streamed client against it, the report and its verdicts; and one short real run of
`dflash-mlx serve` (a tiny model) started, asked twice, and stopped on SIGINT."""

from __future__ import annotations

import json
import sys
import threading
from http.server import ThreadingHTTPServer

import httpx
import pytest
from helpers.paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from agent_replay import capture, report, synth  # noqa: E402
from agent_replay.client import stream_request  # noqa: E402

LONG = "You are a careful assistant that edits code in the user's repository and explains every change."


def _walk_strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_strings(v)
    elif isinstance(node, str):
        yield node


def test_shape_file_holds_shapes_not_prose():
    shapes = synth.load_shapes()
    assert {"claude-code", "codex"} <= set(shapes)
    raw = json.loads(synth.SHAPES.read_text())
    for name, shape in shapes.items():
        assert shape.summary["tools"] == len(shape.skeleton["tools"]) > 0, name
        assert raw[name]["cli"], name
        assert synth.prose_chars(synth.system_part(shape.skeleton, shape.api)) > 1000, name
        for text in _walk_strings(shape.skeleton):  # identifiers, types, names: short, or the billing template
            assert len(text) <= capture.SHORT or synth.SESSION_MARK in text or text.startswith("http"), text
    assert shapes["claude-code"].subagent is not None


def test_skeleton_replaces_prose_and_templates_the_billing_header():
    billing = "x-anthropic-billing-header: cc_version=2.1.197.e77; cc_entrypoint=cli;"
    body = {"system": [{"type": "text", "text": billing}, {"type": "text", "text": LONG}],
            "tools": [{"name": "Read", "description": "Reads.", "input_schema": {
                "type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}}}}],
            "metadata": {"user_id": "913c035147ee88754b32f0998a608cd4"}, "reasoning": {"summary": "auto"}}
    sk = capture.skeleton(body)
    assert sk["system"][0]["text"] == "x-anthropic-billing-header: cc_version=2.1.197.{session3}; cc_entrypoint=cli;"
    assert sk["system"][1]["text"] == {"$text": len(LONG)}
    assert sk["tools"][0]["description"] == {"$text": 6}
    assert sk["tools"][0]["input_schema"]["properties"]["mode"]["enum"] == ["fast", "slow"]
    assert sk["metadata"]["user_id"] == {"$id": 32}
    assert sk["reasoning"]["summary"] == "auto"
    described = capture.describe(body)
    assert described["system_chars"] == len(body["system"][0]["text"]) + len(LONG)
    assert described["tools"][0]["chars"] == len(json.dumps(body["tools"][0]))


def test_filler_is_exact_and_deterministic():
    assert len(synth.filler(1234, "s")) == 1234
    assert synth.filler(300, "s") == synth.filler(300, "s") != synth.filler(300, "t")
    assert synth.filler(0, "s") == ""


def test_sessions_share_system_and_tools_but_not_the_billing_suffix():
    shape = synth.load_shapes()["claude-code"]
    scale = synth.scale_for(shape.skeleton, shape.api, 600)
    assert 0 < scale < 1
    a = synth.first_request(shape, shape.skeleton, "A", synth.PROMPTS["A"], scale, 32)
    b = synth.first_request(shape, shape.skeleton, "B", synth.PROMPTS["B"], scale, 32)
    assert a == synth.first_request(shape, shape.skeleton, "A", synth.PROMPTS["A"], scale, 32)
    assert a["tools"] == b["tools"] and a["system"][1:] == b["system"][1:]
    assert a["system"][0] != b["system"][0]  # the per-session suffix, as the real CLI's
    assert a["messages"][0]["content"][-1]["text"] == synth.PROMPTS["A"]
    assert a["stream"] is True and a["max_tokens"] == 32
    prose = sum(len(t) for t in _walk_strings(a["system"])) + sum(
        len(m["content"]) for m in a["messages"] if m["role"] == "system")
    tool_prose = synth.prose_chars(shape.skeleton["tools"]) * scale
    assert abs(prose + tool_prose - 600 * synth.CHARS_PER_TOKEN) < 0.1 * 600 * synth.CHARS_PER_TOKEN


def test_next_turn_adds_reply_call_and_result():
    shapes = synth.load_shapes()
    claude = shapes["claude-code"]
    body = synth.first_request(claude, claude.skeleton, "A", "hi", 0.05, 16)
    later = synth.next_turn(body, "anthropic", {"blocks": [{"type": "text", "text": "Reading."}]}, "A", 2, 50)
    assistant, result = later["messages"][-2:]
    assert assistant["content"][0] == {"type": "text", "text": "Reading."}
    assert assistant["content"][1]["type"] == "tool_use" and assistant["content"][1]["name"] == "Read"
    assert result["content"][0]["tool_use_id"] == assistant["content"][1]["id"]
    marked = [b for m in later["messages"] if isinstance(m["content"], list) for b in m["content"]
              if "cache_control" in b]
    assert marked == [result["content"][-1]]
    assert len(later["messages"]) == len(body["messages"]) + 2  # the body itself is left as it was
    codex = shapes["codex"]
    body = synth.first_request(codex, codex.skeleton, "A", "hi", 0.1, 16)
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok"}]}
    later = synth.next_turn(body, "responses", {"items": [item]}, "A", 2, 50)
    assert later["input"][-3] == item
    assert later["input"][-2]["type"] == "function_call" and later["input"][-2]["name"] == "exec_command"
    assert later["input"][-1]["type"] == "function_call_output"
    assert later["input"][-1]["call_id"] == later["input"][-2]["call_id"]


@pytest.fixture
def recorder(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), capture.Recorder)
    server.out, server.subagent, server.called = tmp_path, False, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    server.shutdown()
    server.server_close()


def test_recorder_answers_and_the_client_reads_it(recorder):
    url, folder = recorder
    shapes = synth.load_shapes()
    with httpx.Client() as client:
        for shape in shapes.values():
            body = synth.first_request(shape, shape.skeleton, "A", "hi", 0.05, 8)
            out = stream_request(client, url, shape.api, shape.path, body, shape.headers, 10, 10)
            assert out["error"] is None and out["ttft"] is not None, out
            assert out["prompt_tokens"] == 1 and out["cached"] == 0
            assert out["blocks"] or out["items"]
    shaped = capture.derive(folder, {"claude-code": "test", "codex": "test"})
    assert shaped["claude-code"]["cli"] == "test"
    assert len(shaped["codex"]["tools"]) == shapes["codex"].summary["tools"]
    captured = synth.load_captured(folder)
    assert captured["claude-code"].captured and synth.SESSION_MARK in json.dumps(captured["claude-code"].skeleton)


def _row(kind, phase, prompt, cached, ttft=1.0, **extra):
    return {"target": "t", "phase": phase, "agent": "claude-code", "kind": kind, "prompt_tokens": prompt,
            "cached": cached, "ttft": ttft, "prefill_s": ttft, **extra}


def test_report_lines_and_verdicts():
    rows = [_row("first_turn", "A turn 1 (cold)", 1000, 0, ttft=10.0),
            _row("later_turn", "A turn 2", 1100, 1050, ideal=0.95),
            _row("new_session", "B turn 1 (new session)", 1000, 100),
            _row("restart_turn", "restart: A turn 3", 2000, 1900, ttft=4.0)]
    text = report.line(rows[1])
    assert "1100" in text and "95.5" in text and "95.0" in text
    assert len(report.header().split()) >= 9
    later, new, restart = report.verdicts(rows, None)
    assert later["verdict"] == "PASS"
    assert new["verdict"] == "FAIL" and "10.0 %" in new["detail"]
    assert restart["verdict"] == "PASS" and rows[3]["cold_ttft_estimate"] == pytest.approx(20.0)
    rows[3]["ttft"] = 7.0  # 0.35x the cold estimate
    assert report.verdicts(rows, None)[2]["verdict"] == "FAIL"
    skipped = report.verdicts(rows[:3], "no disk tier")
    assert skipped[2]["verdict"] == "NOT MEASURED" and skipped[2]["detail"] == "no disk tier"
    assert report.verdicts([], None)[0]["verdict"] == "NOT MEASURED"
    short = report.verdicts([_row("later_turn", "A turn 2", 1000, 800, ideal=0.81)], None)[0]
    assert short["verdict"] == "FAIL" and "all it could" in short["detail"]


@pytest.mark.cli
def test_serve_starts_answers_and_stops_on_sigint(tmp_path):
    from agent_replay.server import ServeProcess, serve_options
    from helpers.tiny import save_target, tiny_target

    options = serve_options()
    assert "--prompt-cache-bytes" in options
    model = save_target(tiny_target("qwen3", seed=0), "qwen3", tmp_path / "t")
    disk = ["--prompt-cache-dir", str(tmp_path / "cache")] if "--prompt-cache-dir" in options else []
    server = ServeProcess(["--model", str(model), "--no-draft", "--max-tokens-default", "4", *disk], tmp_path / "log")
    try:
        server.start(60)
        messages = [{"role": "user", "content": "abc " * 40}]
        body = {"model": "m", "max_tokens": 4, "stream": True, "messages": messages}
        with httpx.Client() as client:
            first = stream_request(client, server.url, "anthropic", "/v1/messages", body, {}, 30, 30)
            reply = [b for b in first["blocks"] if b.get("text")] or [{"type": "text", "text": "x"}]
            body["messages"] = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
            second = stream_request(client, server.url, "anthropic", "/v1/messages", body, {}, 30, 30)
        assert first["error"] is None and second["error"] is None, (first, second, server.log_tail())
        assert first["prompt_tokens"] > 100 and second["cached"] >= first["prompt_tokens"] - 1
    finally:
        how = server.stop(20)
    assert how.startswith("stopped on SIGINT"), how + server.log_tail()
