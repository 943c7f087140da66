"""Every generation route, fuzzed: bodies built from each API's request schema (the fields the parse functions
read), with wrong types, missing and extra fields, huge and negative numbers, deep and wide nesting and odd
unicode, never get a 5xx; a refusal has its API's error shape, a reply its API's shape (no error event
inside a stream), and afterwards the worker still serves the greedy reply and the prompt cache still holds
a conversation stored before the fuzzing.

The app runs in process (Starlette's TestClient, with the engine's lifespan) on the tiny qwen3 target with a
Hermes/Qwen-like chat template (tools, earlier calls and thinking rendered; `<tool_call>` markup, so forced
calls compile their grammars), and replies are capped at a few tokens: a valid body costs a prefill and a
cycle or two. Hypothesis runs derandomized with no example database, so the run is the same every time.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from helpers.scripted import QWEN_LIKE_TURNS
from helpers.serverkit import MODEL_ID
from helpers.tiny import EOS_ID, greedy_reference, save_target, tiny_drafter, tiny_target
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

import mlx_dflash
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.app import create_app
from mlx_dflash.server.http.state import ServerState

CAP = 3  # tokens a reply may have: valid bodies generate little
EXAMPLES = 150  # bodies per route, besides the FOUND ones
# Tools listed, earlier reasoning and calls rendered, a thinking switch that opens a span: the reply
# parser reads thinking and <tool_call> JSON, and a forced call compiles a grammar of that markup.
TEMPLATE = QWEN_LIKE_TURNS + (
    "{%- if add_generation_prompt %}<a>{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
    "{% endif %}"
)
REMEMBERED = [{"role": "system", "content": "You keep notes."},
              {"role": "user", "content": "Remember this conversation, it is stored in the prompt cache."}]
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


# -- the server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """(TestClient, state, model, remembered): the app serving the tiny target, and the chat completion
    (prompt ids, cached tokens on its repeat) stored in the prompt cache before any fuzzing."""
    from transformers import PreTrainedTokenizerFast

    model = tiny_target("qwen3", seed=0)
    path = save_target(model, "qwen3", tmp_path_factory.mktemp("fuzz"))
    fast = PreTrainedTokenizerFast.from_pretrained(str(path))
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    target, tokenizer, _ = mlx_dflash.load(str(path))
    engine = Engine(target, tokenizer, tiny_drafter(target, block_size=8), EngineConfig(prompt_cache_bytes=1 << 30))
    state = ServerState(engine, MODEL_ID, max_tokens_default=CAP, max_tokens_cap=CAP)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        prompt = list(tokenizer.apply_chat_template(REMEMBERED, add_generation_prompt=True))
        chat(client)
        repeat = chat(client)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert repeat > 0, "the remembered conversation was not served from the prompt cache"
        yield client, state, target, (prompt, repeat)


def chat(client: TestClient) -> dict:
    response = client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": REMEMBERED})
    assert response.status_code == 200, response.text
    return response.json()


def still_serving(fuzz_server) -> None:
    """The worker lives and decodes greedily, and the remembered conversation is still cached."""
    client, state, model, (prompt, cached) = fuzz_server
    assert state.engine._thread is not None and state.engine._thread.is_alive()
    reply = chat(client)
    expected = greedy_reference(model, prompt, CAP)
    expected = expected[: expected.index(EOS_ID)] if EOS_ID in expected else expected
    assert reply["choices"][0]["message"]["content"] == state.tokenizer.decode(expected)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert len(state.engine.prompt_cache) >= 1


# -- values ---------------------------------------------------------------------------------
ODD_STRINGS = ["", " ", "\x00", "\ud800", "a\udfffb", "\U0010ffff", "\u202e\u0301", "\U0001f44d\U0001f3fd", "null",
               "{{ messages }}", "{% raw %}", "<tool_call>", "</tool_call>", "<think>", "</s>", "\n" * 3,
               "tiny", "get_weather", "x" * 400]


def rarely(usual: st.SearchStrategy, other: st.SearchStrategy, one_in: int) -> st.SearchStrategy:
    """`usual`, or `other` once in `one_in` draws (st.one_of would take each half the time); shrinking
    goes towards `usual`."""
    return st.sampled_from(range(one_in)).flatmap(lambda i: other if i == one_in - 1 else usual)


TEXT = rarely(st.text(max_size=8), st.sampled_from(ODD_STRINGS), 3)
NAME = rarely(st.sampled_from(["get_weather", "f", "apply_patch"]), TEXT, 4)
BOOL = st.booleans()
EDGE_INTS = st.sampled_from([0, -1, 1 << 31, (1 << 63) - 1, 1 << 63, -(1 << 63) - 1, 1 << 64, 10 ** 40, -10 ** 40])
# Infinities and NaN go out as bare words, which the server refuses before any route reads the body.
EDGE_FLOATS = rarely(st.sampled_from([0.0, -0.0, 1.0, 1e308, -1e308, 5e-324, 1e-300, 1e-45, 0.9999999999999999]),
                     st.sampled_from([math.inf, -math.inf, math.nan]), 6)


def number(low: float, high: float, integer: bool = False) -> st.SearchStrategy:
    """Mostly in [low, high], now and then an edge: huge, negative, infinite, NaN."""
    inside = st.integers(int(low), int(high)) if integer else st.floats(low, high)
    return rarely(inside, st.one_of(EDGE_INTS, EDGE_FLOATS), 6)


SCALAR = st.one_of(st.none(), BOOL, EDGE_INTS, st.integers(-5, 50), st.floats(allow_nan=False), EDGE_FLOATS, TEXT)
JUNK = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)


def nest(depth: int, kind: type) -> object:
    value: object = "deep"
    for _ in range(depth):
        value = [value] if kind is list else {"k": value}
    return value


# Deep (below and past the server's nesting limit of 64, wherever they land) and wide values.
HUGE = st.sampled_from([nest(20, list), nest(40, dict), nest(70, list), list(range(3000)),
                        {str(i): i for i in range(1000)}, ["x"] * 2000, "y" * 20000])
ANY = rarely(JUNK, HUGE, 6)
WALK_DEPTH = 10  # mutations reach this deep into a body (not into the huge values themselves)


def _places(value: object, depth: int = 0) -> list[tuple[object, object]]:
    """(container, key) of every value in `value`, in a fixed order."""
    if depth > WALK_DEPTH:
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out = []
    for key, inner in list(items)[:20]:
        out.append((value, key))
        out += _places(inner, depth + 1)
    return out


def anything(draw) -> object:
    return copy.deepcopy(draw(ANY))  # a huge value is one object: a copy, so no mutation puts it inside itself


@st.composite
def mutated(draw, valid: st.SearchStrategy) -> dict:
    """A valid body with up to two mutations, anywhere in it: a value replaced by anything at all
    (another type, a huge or deep value), a field or item dropped, or a field no API has added."""
    payload = copy.deepcopy(draw(valid))  # constants of the strategies are never changed in place
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        places = _places(payload)
        container, key = draw(st.sampled_from(places)) if places else (payload, None)
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if key is None or action == "add":
            target = container if key is None or not isinstance(container[key], (dict, list)) else container[key]
            if isinstance(target, dict):
                target[draw(st.one_of(TEXT, st.sampled_from(["type", "name", "content", "stream"])))] = anything(draw)
            elif isinstance(target, list):
                target.append(anything(draw))
        elif action == "drop":
            del container[key]
        else:
            container[key] = anything(draw)
    return payload


def rarely_wrong(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: valid, or now and then anything at all (so a field deep inside gets junk too)."""
    return rarely(valid, ANY, 25)


def obj(required: dict, optional: dict | None = None) -> st.SearchStrategy:
    return st.fixed_dictionaries({k: rarely_wrong(v) for k, v in required.items()},
                                 optional={k: rarely_wrong(v) for k, v in (optional or {}).items()})


def lists(item: st.SearchStrategy, min_size: int = 0, max_size: int = 3) -> st.SearchStrategy:
    return st.lists(item, min_size=min_size, max_size=max_size)


def body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return mutated(obj(required, optional))


SCHEMA = st.one_of(
    st.sampled_from([
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {}, {"type": "string"}, {"type": "object"}, {"$ref": "#/$defs/missing"}, {"enum": []}, {"anyOf": []},
        {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "string", "pattern": "("}, {"type": "strin"},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}, "minItems": 2},
        {"type": "object", "additionalProperties": False, "required": ["nope"]},
        {"properties": 5}, {"type": ["string", "null"]}, {"x-guidance": 7}, {"type": "object", "required": "a"},
    ]),
    st.dictionaries(st.sampled_from(["type", "properties", "required", "items", "enum", "$ref", "format"]), JUNK,
                    max_size=3),
)
TEMPLATE_KWARGS = st.dictionaries(
    st.one_of(TEXT, st.sampled_from(["enable_thinking", "tokenize", "return_dict", "chat_template", "documents",
                                     "return_assistant_tokens_mask", "tokenizer_kwargs", "continue_final_message",
                                     "sanitize_control_tokens", "add_special_tokens", "messages", "tools"])),
    JUNK, max_size=2)
STOP = st.one_of(TEXT, st.lists(TEXT, max_size=3))
SAMPLING = {"temperature": number(0, 2), "top_p": number(0.01, 1), "top_k": number(-1, 200, integer=True),
            "min_p": number(0, 1), "seed": st.one_of(st.integers(), EDGE_INTS),
            "n": rarely(st.just(1), st.sampled_from([0, 2]), 6)}
MAX_TOKENS = number(1, 16, integer=True)

# -- OpenAI chat completions and completions --------------------------------------------------
TEXT_PART = obj({"type": st.just("text"), "text": TEXT})
CHAT_CONTENT = st.one_of(TEXT, lists(TEXT_PART), st.none())
CHAT_CALL = obj({"id": TEXT, "type": st.just("function"),
                 "function": obj({"name": NAME}, {"arguments": st.one_of(st.just('{"city": "Paris"}'), TEXT)})})
CHAT_MESSAGE = st.one_of(
    obj({"role": st.sampled_from(["user", "system", "developer"]), "content": CHAT_CONTENT}, {"name": TEXT}),
    obj({"role": st.just("assistant"), "content": CHAT_CONTENT}, {"tool_calls": lists(CHAT_CALL)}),
    obj({"role": st.just("tool"), "content": CHAT_CONTENT}, {"tool_call_id": TEXT}),
)
USER_FIRST = st.tuples(obj({"role": st.just("user"), "content": CHAT_CONTENT}), lists(CHAT_MESSAGE))
CHAT_MESSAGES = st.one_of(USER_FIRST.map(lambda pair: [pair[0], *pair[1]]), lists(CHAT_MESSAGE, min_size=1))
CHAT_TOOL = obj({"type": st.just("function"),
                 "function": obj({"name": NAME}, {"description": TEXT, "parameters": SCHEMA, "strict": BOOL})})
CHAT_TOOL_CHOICE = st.one_of(st.sampled_from(["none", "auto", "required"]),
                             obj({"type": st.just("function"), "function": obj({"name": NAME})}))
CHAT_FORMAT = st.one_of(obj({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
                        obj({"type": st.just("json_schema"),
                             "json_schema": obj({"name": NAME, "schema": SCHEMA}, {"strict": BOOL})}))
STREAM_OPTIONS = obj({}, {"include_usage": BOOL})
CHAT_BODY = body(
    {"model": st.just(MODEL_ID), "messages": CHAT_MESSAGES},
    {"max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS, **SAMPLING, "stop": STOP, "stream": BOOL,
     "stream_options": STREAM_OPTIONS, "logprobs": BOOL, "top_logprobs": number(0, 22, integer=True),
     "tools": lists(CHAT_TOOL), "tool_choice": CHAT_TOOL_CHOICE, "parallel_tool_calls": BOOL,
     "response_format": CHAT_FORMAT, "chat_template_kwargs": TEMPLATE_KWARGS})
TOKEN_IDS = st.lists(rarely(st.integers(0, 127), st.one_of(st.integers(-2, 140), EDGE_INTS), 10),
                     max_size=6)
COMPLETION_BODY = body(
    {"model": st.just(MODEL_ID),
     "prompt": rarely(st.one_of(st.text(min_size=1, max_size=8), TEXT, TOKEN_IDS.filter(bool),
                                st.lists(st.one_of(TEXT, TOKEN_IDS), min_size=1, max_size=1)),
                      st.one_of(st.lists(TEXT, max_size=2), st.lists(TOKEN_IDS, max_size=2)), 4)},
    {"max_tokens": MAX_TOKENS, **SAMPLING, "stop": STOP, "stream": BOOL, "stream_options": STREAM_OPTIONS,
     "echo": rarely(st.just(False), BOOL, 4), "suffix": rarely(st.none(), TEXT, 4),
     "best_of": rarely(st.just(1), st.just(2), 4), "logprobs": number(0, 22, integer=True)})

# -- Anthropic Messages and count_tokens ------------------------------------------------------
CACHE_CONTROL = obj({"type": st.just("ephemeral")})
TEXT_BLOCK = obj({"type": st.just("text"), "text": TEXT}, {"cache_control": CACHE_CONTROL})
USER_BLOCK = st.one_of(
    TEXT_BLOCK, TEXT_BLOCK,
    obj({"type": st.just("tool_result"), "tool_use_id": TEXT,
         "content": st.one_of(TEXT, lists(TEXT_BLOCK), st.lists(obj({"type": st.just("image"), "source": JUNK})))},
        {"is_error": BOOL}),
    obj({"type": st.sampled_from(["image", "document", "server_tool_use", "web_search_tool_result"]),
         "source": JUNK}),
)
ASSISTANT_BLOCK = st.one_of(
    TEXT_BLOCK,
    obj({"type": st.just("tool_use"), "id": TEXT, "name": NAME, "input": st.dictionaries(TEXT, JUNK, max_size=2)}),
    obj({"type": st.just("thinking"), "thinking": TEXT, "signature": TEXT}),
    obj({"type": st.just("redacted_thinking"), "data": TEXT}),
)
ANTHROPIC_MESSAGE = st.one_of(
    obj({"role": st.just("user"), "content": st.one_of(TEXT, lists(USER_BLOCK))}),
    obj({"role": st.just("assistant"), "content": st.one_of(TEXT, lists(ASSISTANT_BLOCK))}),
    obj({"role": st.just("system"), "content": st.one_of(TEXT, lists(TEXT_BLOCK))}),
)
ANTHROPIC_MESSAGES = st.tuples(obj({"role": st.just("user"), "content": st.one_of(TEXT, lists(USER_BLOCK))}),
                               lists(ANTHROPIC_MESSAGE)).map(lambda pair: [pair[0], *pair[1]])
ANTHROPIC_TOOL = st.one_of(
    obj({"name": NAME}, {"description": TEXT, "input_schema": SCHEMA, "cache_control": CACHE_CONTROL,
                         "type": st.just("custom")}),
    obj({"type": st.sampled_from(["web_search_20250305", "bash_20250124", "text_editor_20250728"]), "name": NAME}),
)
ANTHROPIC_FORMAT = st.one_of(obj({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
                             obj({"type": st.just("json_schema"), "schema": SCHEMA}))
ANTHROPIC_PROMPT = {
    "system": st.one_of(TEXT, lists(TEXT_BLOCK)), "tools": lists(ANTHROPIC_TOOL),
    "tool_choice": obj({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                       {"name": NAME, "disable_parallel_tool_use": BOOL}),
    "thinking": obj({"type": st.sampled_from(["enabled", "adaptive", "disabled", "between_tools"])},
                    {"budget_tokens": number(1, 100000, integer=True),
                     "display": st.sampled_from(["summarized", "omitted"])}),
    "output_config": obj({}, {"format": ANTHROPIC_FORMAT, "effort": st.sampled_from(["low", "high", "max"])}),
    "output_format": ANTHROPIC_FORMAT, "metadata": obj({}, {"user_id": TEXT}),
}
ANTHROPIC_REQUIRED = {"model": st.just(MODEL_ID), "messages": ANTHROPIC_MESSAGES}
MESSAGES_BODY = body(
    dict(ANTHROPIC_REQUIRED, max_tokens=MAX_TOKENS),
    {**ANTHROPIC_PROMPT, "temperature": number(0, 1), "top_p": number(0.01, 1),
     "top_k": number(-1, 200, integer=True), "stop_sequences": STOP, "stream": BOOL})
COUNT_BODY = body(ANTHROPIC_REQUIRED, ANTHROPIC_PROMPT)

# -- OpenAI Responses -------------------------------------------------------------------------
PART = st.one_of(obj({"type": st.sampled_from(["input_text", "output_text", "text"]), "text": TEXT}),
                 obj({"type": st.just("refusal"), "refusal": TEXT}),
                 obj({"type": st.sampled_from(["input_image", "input_file"])}, {"image_url": TEXT}))
ITEM = st.one_of(
    obj({"role": st.sampled_from(["user", "user", "system", "developer", "assistant"]),
         "content": st.one_of(TEXT, lists(PART))}, {"type": st.just("message")}),
    obj({"type": st.just("function_call"), "call_id": TEXT, "name": NAME},
        {"arguments": st.one_of(st.just("{}"), TEXT)}),
    obj({"type": st.just("custom_tool_call"), "call_id": TEXT, "name": NAME, "input": TEXT}),
    obj({"type": st.sampled_from(["function_call_output", "custom_tool_call_output"]), "call_id": TEXT,
         "output": st.one_of(TEXT, lists(PART))}),
    obj({"type": st.just("reasoning")},
        {"content": lists(obj({"type": st.just("reasoning_text"), "text": TEXT})), "summary": st.just([])}),
    obj({"type": st.sampled_from(["item_reference", "web_search_call", "computer_call"]), "id": TEXT}),
)
RESPONSES_INPUT = st.one_of(TEXT, st.tuples(obj({"role": st.just("user"), "content": TEXT}), lists(ITEM))
                            .map(lambda pair: [pair[0], *pair[1]]), lists(ITEM, min_size=1))
RESPONSES_FUNCTION = obj({"type": st.just("function"), "name": NAME},
                         {"parameters": SCHEMA, "description": TEXT, "strict": BOOL})
RESPONSES_CUSTOM = obj({"type": st.just("custom"), "name": NAME},
                       {"description": TEXT, "format": obj({"type": st.sampled_from(["grammar", "text"])},
                                                           {"syntax": st.sampled_from(["lark", "regex"]),
                                                            "definition": TEXT})})
RESPONSES_TOOL = st.one_of(
    RESPONSES_FUNCTION, RESPONSES_CUSTOM,
    obj({"type": st.just("namespace"), "name": TEXT,
         "tools": lists(st.one_of(RESPONSES_FUNCTION, RESPONSES_CUSTOM))}),
    obj({"type": st.sampled_from(["web_search", "local_shell", "mcp"])}),
)
RESPONSES_TOOL_CHOICE = st.one_of(
    st.sampled_from(["auto", "none", "required"]),
    obj({"type": st.sampled_from(["function", "custom"]), "name": NAME}),
    obj({"type": st.just("allowed_tools"), "mode": st.sampled_from(["auto", "required", "none"]),
         "tools": lists(obj({"type": st.sampled_from(["function", "custom"]), "name": NAME}))}),
)
RESPONSES_FORMAT = st.one_of(obj({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
                             obj({"type": st.just("json_schema"), "name": NAME, "schema": SCHEMA}, {"strict": BOOL}))
RESPONSES_BODY = body(
    {"model": st.just(MODEL_ID), "input": RESPONSES_INPUT},
    {"instructions": TEXT, "max_output_tokens": MAX_TOKENS, **SAMPLING, "stream": BOOL,
     "store": st.just(False), "background": st.just(False), "previous_response_id": st.none(),
     "parallel_tool_calls": BOOL, "tools": lists(RESPONSES_TOOL), "tool_choice": RESPONSES_TOOL_CHOICE,
     "text": obj({}, {"format": RESPONSES_FORMAT, "verbosity": st.sampled_from(["low", "medium"])}),
     "reasoning": obj({}, {"effort": st.sampled_from(["none", "minimal", "low", "high"]),
                           "summary": st.sampled_from(["auto", "detailed"])}),
     "metadata": st.dictionaries(TEXT, TEXT, max_size=2), "prompt_cache_key": TEXT,
     "include": st.lists(st.sampled_from(["reasoning.encrypted_content"]), max_size=1),
     "chat_template_kwargs": TEMPLATE_KWARGS})

BODIES = {"/v1/chat/completions": CHAT_BODY, "/v1/completions": COMPLETION_BODY, "/v1/messages": MESSAGES_BODY,
          "/v1/messages/count_tokens": COUNT_BODY, "/v1/responses": RESPONSES_BODY}


# -- checks ---------------------------------------------------------------------------------
def strict_json(text: str) -> object:
    """JSON as clients parse it: NaN and Infinity are no JSON numbers."""
    def refuse(word: str) -> None:
        raise AssertionError(f"{word} in a reply: not JSON")

    return json.loads(text, parse_constant=refuse)


def events(text: str) -> list[dict]:
    """The JSON data of each server-sent event (keep-alives and [DONE] left out)."""
    out = []
    for frame in text.split("\n\n"):
        for line in frame.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(strict_json(line[len("data: "):]))
    return out


def check_error(route: str, payload: dict) -> None:
    if route.startswith("/v1/messages"):
        assert payload.keys() == {"type", "error"} and payload["type"] == "error", payload
        assert payload["error"].keys() == {"type", "message"}, payload
        assert isinstance(payload["error"]["type"], str) and payload["error"]["type"].endswith("error") \
            or payload["error"]["type"] == "request_too_large", payload
        assert isinstance(payload["error"]["message"], str) and payload["error"]["message"], payload
        return
    assert payload.keys() == {"error"} and payload["error"].keys() == OPENAI_ERROR_KEYS, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error", payload  # a client's mistake, in OpenAI's words
    assert isinstance(error["message"], str) and error["message"], payload
    assert error["param"] is None or isinstance(error["param"], str), payload
    assert error["code"] is None or isinstance(error["code"], str), payload


def check_reply(route: str, streamed: bool, response) -> None:
    if route == "/v1/messages/count_tokens":
        payload = response.json()
        assert isinstance(payload["input_tokens"], int) and payload["input_tokens"] > 0, payload
        return
    if not streamed:
        payload = strict_json(response.text)
        if route == "/v1/messages":
            assert payload["type"] == "message" and payload["stop_reason"] is not None, payload
        elif route == "/v1/responses":
            assert payload["object"] == "response" and payload["status"] in ("completed", "incomplete"), payload
        else:
            assert payload["choices"][0]["finish_reason"] is not None, payload
        return
    data = events(response.text)
    assert data, response.text
    if route == "/v1/messages":
        assert all(d["type"] != "error" for d in data) and data[-1]["type"] == "message_stop", data
    elif route == "/v1/responses":
        assert data[-1]["type"] in ("response.completed", "response.incomplete"), data[-1]
    else:
        assert all("error" not in d for d in data), data
        assert any(c["finish_reason"] for d in data for c in d.get("choices", [])), data
        assert response.text.endswith("data: [DONE]\n\n")


def post(client: TestClient, route: str, payload: dict):
    # json.dumps as clients send it: ASCII escapes (lone surrogates too); inf and nan as bare words.
    return client.post(route, content=json.dumps(payload), headers={"Content-Type": "application/json"})


# Bodies the fuzzing found 5xx replies to, always tried first.
FOUND = {
    "/v1/chat/completions": [
        # Sampling colder than the sampler's 1/temperature can hold (NaN logits) broke the grammar: 500.
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "</s>"}], "temperature": 5e-324,
         "response_format": {"type": "json_object"}},
        {"model": MODEL_ID, "messages": [{"role": "system", "content": "</s>"}], "temperature": 1e-45,
         "response_format": {"type": "json_object"}, "stream": True},
        # A top-p that rounds to 0 in float32 kept no token: garbage, outside the grammar.
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "temperature": 1, "top_p": 1e-300,
         "response_format": {"type": "json_object"}},
        # Logprobs of tokens a grammar rules out (-inf) in a reply: no JSON (a 500, or -Infinity in a stream).
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3,
         "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
         "response_format": {"type": "json_object"}, "stream": True},
    ],
    "/v1/completions": [{"model": MODEL_ID, "prompt": "\ud800"},  # a lone surrogate reached the tokenizer
                        {"model": MODEL_ID, "prompt": ["a\udfffb"], "stream": True}],
    "/v1/messages": [
        {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "temperature": 1e-300,
         "output_format": {"type": "json_schema", "schema": {"type": "object"}}},
        {"model": MODEL_ID, "max_tokens": 9, "messages": [{"role": "user", "content": "x"}], "temperature": 0.8,
         "top_p": 1e-300, "output_format": {"type": "json_schema", "schema": {}}, "stream": True},
    ],
    "/v1/messages/count_tokens": [{"model": MODEL_ID, "messages": [{"role": "user", "content": "a\udfffb"}]}],
    "/v1/responses": [
        {"model": MODEL_ID, "input": "hi", "tool_choice": {"type": "allowed_tools", "tools": 5}},
        {"model": MODEL_ID, "input": "hi", "tool_choice": {"type": "allowed_tools", "tools": True}},
        {"model": MODEL_ID, "input": "hi", "tool_choice": {"type": "allowed_tools", "tools": [{"name": []}]}},
        # Echoed in the response object, which then could not be encoded: 500 (and a broken stream).
        {"model": MODEL_ID, "input": "hi", "metadata": {"\ud800": "x"}},
        {"model": MODEL_ID, "input": "hi", "tools": [{"type": "function", "name": "f", "description": "\udfff"}],
         "stream": True},
    ],
}


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_bodies_never_get_a_5xx_and_the_worker_serves_on(fuzz_server, route):
    client = fuzz_server[0]

    def check(payload: dict) -> None:
        response = post(client, route, payload)
        assert response.status_code < 500, (response.status_code, response.text[:2000])
        if response.status_code >= 400:
            check_error(route, response.json())
        else:
            assert response.status_code == 200
            check_reply(route, payload.get("stream") is True, response)

    run = given(payload=BODIES[route])(check)
    for payload in FOUND[route]:
        run = example(payload=payload)(run)
    settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
             suppress_health_check=list(HealthCheck))(run)()
    still_serving(fuzz_server)
