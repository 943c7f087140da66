"""Anthropic Messages as Claude Code sends it, against a live server and a scripted thinking model.

The target is a tiny real model made to emit fixed whole-string tokens (scripted.scripted_pair)
under a Qwen3-like template with `<think>` and `<tool_call>`: after a question it thinks, then
calls a tool; after a tool result it answers. So thinking blocks, tool_use blocks and the round
trip are checked on real decoding (with a DFlash drafter).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from helpers.scripted import scripted_pair
from helpers.serverkit import MODEL_ID, LiveServer, anthropic_client
from helpers.tiny import EOS_ID, greedy_reference

THOUGHT = "The user asks about the weather, so I call the weather tool."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
JSON_REPLY = '{"city": "Paris"}'  # the model's second choice where it would call the tool unasked
# Qwen3's structure, shortened: tools in the system turn, system messages after the first one in
# place, reasoning kept on assistant turns, tool results as user turns, and enable_thinking=false
# closing an empty think span. The generation prompt ends in ':' after a question and in '=' after
# a tool result, which is what the scripted model answers to.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{%- for tool_call in m.tool_calls or [] %}{% if tool_call.function %}{% set tool_call = tool_call.function %}"
    "{% endif %}<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{% if messages[-1].role == 'tool' %}={% else %}:{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
WORDS = ["\n", "<think>", "</think>", THOUGHT, CALL, ANSWER, JSON_REPLY]  # whole-string tokens
# The next token after each of these (the model sees only its last token), and its logit.
SCRIPT = [(":", "<think>", 50), ("<think>", THOUGHT, 50), (THOUGHT, "</think>", 50), ("</think>", CALL, 50),
          (CALL, "</s>", 50), ("=", ANSWER, 50), (ANSWER, "</s>", 50), ("\n", CALL, 50), ("\n", JSON_REPLY, 25),
          (JSON_REPLY, "</s>", 50)]
CONTEXT = 32768  # room for a Claude Code-sized prompt
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # Two layers: a long prompt stays quick.
    return scripted_pair(tmp_path_factory.mktemp("claude_code"), template=TEMPLATE, strings=WORDS, script=SCRIPT,
                         num_layers=2, context=CONTEXT, target_layer_ids=[0, 1])


@pytest.fixture(scope="module")
def server(pair):
    with LiveServer(*pair) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server, timeout=120)


def rendered(pair, messages: list[dict], tools: list[dict] | None = None, **options) -> list[int]:
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                      "parameters": t["input_schema"]}} for t in tools or []]
    return list(pair[1].apply_chat_template(messages, tools=openai_tools or None, add_generation_prompt=True,
                                            **options))


def target_alone(pair, prompt: list[int], n: int = 16) -> str:
    out = greedy_reference(pair[0], prompt, n)
    return pair[1].decode(out[: out.index(EOS_ID)] if EOS_ID in out else out)


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def test_thinking_and_tool_use_not_streamed(pair, client):
    assert target_alone(pair, rendered(pair, QUESTION, [WEATHER])) == "<think>" + THOUGHT + "</think>" + CALL
    reply = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    assert reply.content[0].thinking == THOUGHT and reply.content[0].signature
    use = reply.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    assert reply.stop_reason == "tool_use" and reply.usage.output_tokens == 4  # <think> THOUGHT </think> CALL


def test_thinking_streamed_as_thinking_blocks(server):
    body = {"model": MODEL_ID, "max_tokens": 64, "stream": True, "tools": [WEATHER], "messages": QUESTION,
            "thinking": {"type": "adaptive"}}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    kinds = [e["type"] + ("." + e["delta"]["type"] if e["type"] == "content_block_delta" else "") for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
    thinking = [e for e in events if e.get("index") == 0]
    assert [e["type"] for e in thinking[1:]][-2:] == ["content_block_delta", "content_block_stop"]
    assert thinking[-2]["delta"]["type"] == "signature_delta" and thinking[-2]["delta"]["signature"]
    assert "".join(e["delta"].get("thinking", "") for e in thinking[1:-2]) == THOUGHT
    tool = [e for e in events if e.get("index") == 1]
    assert tool[0]["content_block"]["type"] == "tool_use" and tool[0]["content_block"]["input"] == {}
    assert json.loads(tool[1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert tool[2]["type"] == "content_block_stop" and len(tool) == 3
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_sdk_stream_accumulates_thinking_and_tool_use(client):
    with client.messages.stream(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == THOUGHT and final.content[1].input == {"city": "Paris"}


def test_thinking_display_omitted_keeps_the_signature_only(client):
    reply = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                   thinking={"type": "adaptive", "display": "omitted"})
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    assert reply.content[0].thinking == "" and reply.content[0].signature


def test_thinking_disabled_reaches_the_template(pair, client):
    prompt = rendered(pair, QUESTION, [WEATHER], enable_thinking=False)
    assert target_alone(pair, prompt) == CALL
    counted = client.messages.count_tokens(model=MODEL_ID, messages=QUESTION, tools=[WEATHER],
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == len(prompt)
    reply = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                   thinking={"type": "disabled"})
    assert [b.type for b in reply.content] == ["tool_use"] and reply.usage.output_tokens == 1


def test_tool_round_trip_with_thinking_in_history(pair, client):
    first = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION)
    use = first.content[1]
    history = QUESTION + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]
         + [{"type": "redacted_thinking", "data": "opaque"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                      "content": [{"type": "text", "text": "sunny,"},
                                                  {"type": "text", "text": "24 C"}]}]},
    ]
    expected = QUESTION + [
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Error: sunny,\n\n24 C"},
    ]
    prompt = rendered(pair, expected, [WEATHER])
    text = pair[1].decode(prompt)
    assert "<think>\n" + THOUGHT + "\n</think>" in text and CALL in text  # the turn as the model wrote it
    assert client.messages.count_tokens(model=MODEL_ID, messages=history, tools=[WEATHER]).input_tokens == len(prompt)
    assert target_alone(pair, prompt) == ANSWER
    second = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=history)
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == ANSWER
    assert second.stop_reason == "end_turn"


def test_tool_choice(client):
    # A forced call is decoded under the call grammar with thinking off (the prompt closes an empty think
    # span): the call, without the thinking the model does unforced (test_server_tool_choice.py: the rest).
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        forced = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                        tool_choice=choice)
        assert forced.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in forced.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_ID, max_tokens=8, tools=[WEATHER], messages=QUESTION,
                               tool_choice={"type": "tool", "name": "get_time"})
    assert "tool_choice" in caught.value.message and "get_time" in caught.value.message
    auto = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                  tool_choice={"type": "auto"})
    assert auto.stop_reason == "tool_use"
    none = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                  tool_choice={"type": "none"})
    assert none.stop_reason == "end_turn" and [b.type for b in none.content] == ["thinking", "text"]
    assert none.content[1].text == CALL  # no tools offered: markup is text


def test_structured_output(pair, client):
    """`output_config.format` (and the older `output_format`): the reply is JSON text, with thinking turned off."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    prompt = rendered(pair, QUESTION, [WEATHER], enable_thinking=False)
    assert target_alone(pair, prompt) == CALL  # what the model says unconstrained
    for where in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        reply = client.messages.create(model=MODEL_ID, max_tokens=64, tools=[WEATHER], messages=QUESTION,
                                       extra_body=where)
        assert [b.type for b in reply.content] == ["text"] and json.loads(reply.content[0].text) == {"city": "Paris"}
        assert reply.stop_reason == "end_turn" and reply.usage.input_tokens + \
            (reply.usage.cache_read_input_tokens or 0) == len(prompt)
        counted = client.messages.count_tokens(model=MODEL_ID, messages=QUESTION, tools=[WEATHER], extra_body=where)
        assert counted.input_tokens == len(prompt)
    with client.messages.stream(model=MODEL_ID, max_tokens=64, messages=QUESTION,
                                extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}}) \
            as stream:
        assert stream.get_final_message().content[0].text == JSON_REPLY
    for bad in ({"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema", "schema": {"type": "object",
                                                                                          "not": {}}}):
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL_ID, max_tokens=8, messages=QUESTION,
                                   extra_body={"output_config": {"format": bad}})


# -- a request shaped like Claude Code's first one ------------------------------------------
def _custom_tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": properties, "required": required,
                             "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}


def claude_code_tools() -> list[dict]:
    """24 tools as Claude Code lists them (with shorter descriptions): custom tools, then Anthropic-defined ones."""
    text = {"type": "string"}
    names = ["Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read", "Edit", "Write", "NotebookEdit", "WebFetch",
             "TodoWrite", "WebSearch", "BashOutput", "KillShell", "SlashCommand", "Skill", "AskUserQuestion",
             "ListMcpResources", "ReadMcpResource", "mcp__ide__getDiagnostics"]
    tools = []
    for i, name in enumerate(names):
        description = f"{name}: a tool of the coding agent.\n\nUsage:\n- Follow the repository's conventions.\n"
        tools.append(_custom_tool(name, description, {"command": dict(text, description="What to run"),
                                                      f"option_{i}": {"type": "boolean"}}, ["command"]))
    tools.append(dict(WEATHER))
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    tools += [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
              {"type": "bash_20250124", "name": "bash"},
              {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]
    return tools


def claude_code_body() -> dict:
    system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
               "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering "
               "tasks. " * 10 + "\n# Environment\nWorking directory: /work/project\nPlatform: darwin",
               "cache_control": {"type": "ephemeral"}}]
    reminder = "<system-reminder>\nAs you answer the user's questions, you can use the following context.\n" \
               "</system-reminder>"
    messages = [
        {"role": "user", "content": [{"type": "text", "text": reminder},
                                     {"type": "text", "text": "What is the weather in Paris?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "The user is working in a git repository on branch main."},
        {"role": "user", "content": "Answer briefly."},
    ]
    return {"model": MODEL_ID, "max_tokens": 32000, "stream": True,
            "system": system, "messages": messages, "tools": claude_code_tools(),
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user_0123_account__session_4567"}}


def claude_code_expected(body: dict) -> tuple[list[dict], list[dict]]:
    """The body's conversation and custom tools as the template takes them."""
    system = "\n\n".join(b["text"] for b in body["system"])
    first = body["messages"][0]["content"]
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": first[0]["text"] + "\n\n" + first[1]["text"]},
                {"role": "system", "content": body["messages"][1]["content"]},
                {"role": "user", "content": body["messages"][2]["content"]}]
    return messages, [t for t in body["tools"] if t.get("type") in (None, "custom")]


def test_claude_code_first_request(pair, server):
    body = claude_code_body()
    assert len(body["tools"]) == 24 and len(claude_code_expected(body)[1]) == 21
    messages, tools = claude_code_expected(body)
    prompt = rendered(pair, messages, tools, enable_thinking=True)
    assert len(prompt) > 6000  # Claude Code's own is about 18k tokens: less keeps the test quick on a CPU
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused", "anthropic-dangerous-direct-browser-access":
               "true", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
               "context-management-2025-06-27,fine-grained-tool-streaming-2025-05-14"}
    response = httpx.post(server.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    assert events[0]["message"]["usage"]["input_tokens"] == len(prompt)
    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[1]["name"] == "get_weather"
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    arguments = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    # Greedy through the server is the target alone: the same reasoning and the same call.
    alone = target_alone(pair, prompt)
    assert alone == "<think>" + thinking + "</think>" + CALL
    assert {"name": blocks[1]["name"], "arguments": json.loads(arguments)} == json.loads(CALL.split("\n")[1])
    final = events[-2]
    assert final["type"] == "message_delta" and final["delta"]["stop_reason"] == "tool_use"
    assert final["usage"]["output_tokens"] == 4
    assert final["usage"]["input_tokens"] + final["usage"]["cache_read_input_tokens"] == len(prompt)

    counted = httpx.post(server.url + "/v1/messages/count_tokens?beta=true", headers=headers, timeout=60,
                         json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")})
    assert counted.status_code == 200 and counted.json() == {"input_tokens": len(prompt)}
