"""Replies split into text, reasoning and tool calls in each family's format (`server.reply`), on their own
(fed at every split of the text) and through chat completions with a scripted target that thinks and calls."""

from __future__ import annotations

import json

import httpx
import mlx_lm
import pytest
from helpers.scripted import scripted_pair, scripted_tokenizer
from helpers.serverkit import MODEL_ID, LiveServer, openai_client
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.tool_parsers import json_tools, mistral, qwen3_coder

from mlx_dflash.server.reply.parser import ReasoningDelta, ReplyFormat, ReplyParser, TextDelta, ToolCallItem

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
    "hour": {"type": "integer"}, "ratio": {"type": "number"}, "loud": {"type": "boolean"},
    "label": {"type": "string"}, "days": {"type": "array", "items": {"type": "string"}}}}}}
TOOLS = [WEATHER, TIME, ALARM]

HERMES = ReplyFormat(think_start="<think>", think_end="</think>", tool_start=json_tools.tool_call_start,
                     tool_end=json_tools.tool_call_end, tool_parser=json_tools.parse_tool_call)
CODER = ReplyFormat(think_start="<think>", think_end="</think>", tool_start=qwen3_coder.tool_call_start,
                    tool_end=qwen3_coder.tool_call_end, tool_parser=qwen3_coder.parse_tool_call)
MISTRAL = ReplyFormat(tool_start=mistral.tool_call_start, tool_end=mistral.tool_call_end,
                      tool_parser=mistral.parse_tool_call)
LLAMA = ReplyFormat("llama3_json")
HARMONY = ReplyFormat("harmony")


def call(name, **arguments):
    return ("call", name, arguments)


def normal(events) -> list[tuple]:
    """Events with adjacent deltas of a kind joined and calls without their (random) ids."""
    out: list[tuple] = []
    for e in events:
        if isinstance(e, ToolCallItem):
            out.append(("call", e.name, e.arguments))
            continue
        kind = "text" if isinstance(e, TextDelta) else "reasoning"
        assert isinstance(e, (TextDelta, ReasoningDelta)) and e.text
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + e.text)
        else:
            out.append((kind, e.text))
    return out


def parse_at_every_split(fmt, text, tools=TOOLS, reasoning=False, prefix="call_") -> list[tuple]:
    """The events of `text` fed whole, in two pieces split at every position, and one character at a time:
    each way must give the same events (and the same `calls`)."""
    feeds = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    results = []
    for pieces in feeds:
        parser = ReplyParser(fmt, tools=tools, reasoning=reasoning, call_id_prefix=prefix)
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        assert [e for e in events if isinstance(e, ToolCallItem)] == parser.calls
        assert all(c.id.startswith(prefix) and len(c.id) > len(prefix) + 8 for c in parser.calls)
        results.append(normal(events))
    for result, pieces in zip(results, feeds, strict=True):
        assert result == results[0], pieces
    return results[0]


def test_hermes_json_reasoning_text_and_calls_with_a_malformed_one_among_them():
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    text = ('<think>\nThey want weather and time.\n</think>\n\nChecking both.\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            f'{bad}\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>\n'
            'Both asked.')
    assert parse_at_every_split(HERMES, text) == [
        ("reasoning", "They want weather and time."), ("text", "Checking both."),
        call("get_weather", city="Paris"), ("text", bad), call("get_time", zone="CET"), ("text", "Both asked.")]


def test_without_tools_call_markup_stays_text_and_reasoning_is_still_read():
    text = '<think>hm</think>Sure: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parse_at_every_split(HERMES, text, tools=None) == [
        ("reasoning", "hm"), ("text", 'Sure: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')]


def test_a_call_cut_short_is_kept_as_text_as_it_was():
    for text in ('On it.\n<tool_call>\n{"name": "get_weather", "argu', "Write <tool_call> tags."):
        assert parse_at_every_split(HERMES, text) == [("text", text)]
    for text in ('Hi <|python_tag|>{"name": "get_weather", "param', "Hi <|python_tag|>print(1)"):
        assert parse_at_every_split(LLAMA, text) == [("text", text)]


def test_plain_text_passes_unchanged():
    text = "  Two spaces, a {brace}, <think-ish> and a newline\n\n"
    for fmt in (HERMES, CODER, LLAMA, MISTRAL, HARMONY):
        assert parse_at_every_split(fmt, text) == [("text", text)], fmt.style


def test_qwen3_coder_xml_arguments_typed_by_the_tools_schema():
    good = ('<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n<parameter=ratio>\n0.5\n'
            '</parameter>\n<parameter=loud>\ntrue\n</parameter>\n<parameter=label>\n7 sharp\n</parameter>\n'
            '<parameter=days>\n["mon", "tue"]\n</parameter>\n</function>\n</tool_call>')
    bad = '<tool_call>\n<function=set_alarm>\n<parameter=hour>\nseven\n</parameter>\n</function>\n</tool_call>'
    other = '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>'
    events = parse_at_every_split(CODER, f"Setting it.\n{good}\n{bad}\n{other}")
    assert events == [("text", "Setting it."),
                      call("set_alarm", hour=7, ratio=0.5, loud=True, label="7 sharp", days=["mon", "tue"]),
                      ("text", bad), call("get_weather", city="Paris")]


def test_llama3_json_calls_bare_or_after_the_python_tag():
    two = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert parse_at_every_split(LLAMA, two) == [call("get_weather", city="Paris"), call("get_time")]
    tricky = 'a "}\\" b{'  # quotes, a backslash and braces inside a string
    quoted = '{"name": "get_weather", "parameters": {"city": ' + json.dumps(tricky) + '}}'
    assert parse_at_every_split(LLAMA, quoted) == [call("get_weather", city=tricky)]
    tagged = 'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_at_every_split(LLAMA, tagged) == [("text", "Let me check."), call("get_weather", city="Paris")]
    mixed = ('\n{"name": "get_weather", "parameters": {"city": "Paris"}}; {"oops": "}"}; '
             '{"name": "get_time", "parameters": {"zone": "CET"}}\nDone.')
    assert parse_at_every_split(LLAMA, mixed) == [call("get_weather", city="Paris"), ("text", '{"oops": "}"}'),
                                                  call("get_time", zone="CET"), ("text", "Done.")]


def test_llama3_json_call_after_thinking():
    thinking = ReplyFormat("llama3_json", think_start="<think>", think_end="</think>")
    text = '<think>Weather, then.</think>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_at_every_split(thinking, text) == [("reasoning", "Weather, then."), call("get_weather", city="Paris")]
    assert parse_at_every_split(thinking, "<think>Easy.</think>\n\n It is 4.") == [
        ("reasoning", "Easy."), ("text", "It is 4.")]


def test_llama3_json_that_is_no_call_stays_text():
    for text in ('{"answer": 42} is the JSON you asked for.', '<|python_tag|>brave_search.call(query="x")',
                 '{"name": "get_weather", "parameters": {"city": "Par'):
        assert parse_at_every_split(LLAMA, text) == [("text", text)]
    assert parse_at_every_split(LLAMA, '{"name": "get_weather", "parameters": {}}', tools=None) == [
        ("text", '{"name": "get_weather", "parameters": {}}')]


def test_gpt_oss_channels():
    analysis = "<|channel|>analysis<|message|>Need the weather.<|end|>"
    called = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
              '<|message|>{"city": "Paris"}')
    # <|call|> and <|return|> end generation (they are stop tokens), so a reply usually ends without them.
    assert parse_at_every_split(HARMONY, analysis + called) == [
        ("reasoning", "Need the weather."), call("get_weather", city="Paris")]
    assert parse_at_every_split(HARMONY, analysis + called + "<|call|>") == [
        ("reasoning", "Need the weather."), call("get_weather", city="Paris")]
    final = "<|start|>assistant<|channel|>final<|message|>It is sunny.\n<|return|>"
    assert parse_at_every_split(HARMONY, analysis + final) == [
        ("reasoning", "Need the weather."), ("text", "It is sunny.\n")]
    bad = '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": <|call|>'
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    assert parse_at_every_split(HARMONY, preamble + bad + called) == [
        ("text", 'Checking.{"zone": '), call("get_weather", city="Paris")]
    assert parse_at_every_split(HARMONY, called, tools=None) == [("text", '{"city": "Paris"}')]


def test_mistral_calls_run_to_the_end_of_the_reply():
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}get_time[ARGS]{"zone": "CET"}'
    assert parse_at_every_split(MISTRAL, text) == [("text", "Sure."), call("get_weather", city="Paris"),
                                                   call("get_time", zone="CET")]


def test_reasoning_opened_by_the_prompt_and_left_open():
    assert parse_at_every_split(HERMES, "Still thinking.\n</think>\n\nIt is sunny.", reasoning=True) == [
        ("reasoning", "Still thinking."), ("text", "It is sunny.")]
    assert parse_at_every_split(HERMES, "<think>\nHalf a thought, cut", prefix="toolu_") == [
        ("reasoning", "Half a thought, cut")]
    assert parse_at_every_split(HARMONY, "Thinking<|end|><|start|>assistant<|channel|>final<|message|>Hi",
                                reasoning=True) == [("reasoning", "Thinking"), ("text", "Hi")]
    assert HERMES.opens_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not HERMES.opens_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not HERMES.opens_in_reasoning("What does <think> mean?<|im_end|>\n<|im_start|>assistant\n")
    assert not LLAMA.opens_in_reasoning("<think>\n")
    assert HARMONY.opens_in_reasoning("<|start|>assistant<|channel|>analysis<|message|>")
    assert not HARMONY.opens_in_reasoning("<|start|>assistant")


class TemplateOnly:
    """A tokenizer known by its chat template alone (mlx-lm inferred nothing for it)."""

    def __init__(self, template: str, vocab: dict | None = None):
        self.chat_template = template
        self.vocab = vocab or {}

    def get_vocab(self) -> dict:
        return self.vocab


@pytest.mark.parametrize("template, style, tool_format, think", [
    ('{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}', "marked", "json_tools", None),
    ("{{- '<think>\\n\\n</think>\\n\\n' }}<tool_call>{{ c | tojson }}</tool_call>", "marked", "json_tools",
     "<think>"),
    ("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "marked", "qwen3_coder", None),
    ("<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call.name }}", "llama3_json",
     "llama3_json", None),
    ("<|start_header_id|>assistant<|end_header_id|>{{- '{\"name\": \"' + tool_call.name + '\", ' }}"
     "{{- '\"parameters\": ' }}", "llama3_json", "llama3_json", None),
    ("<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>", "harmony", "harmony", None),
    ("{{ m.content }}", "marked", None, None),
])
def test_format_read_off_the_chat_template(template, style, tool_format, think):
    fmt = ReplyFormat.of(TemplateOnly(template))
    assert (fmt.style, fmt.tool_format, fmt.think_start) == (style, tool_format, think)
    assert ReplyFormat.of(TemplateOnly("", {"<|channel|>": 1, "<|message|>": 2})).style == "harmony"


def test_format_of_mlx_lm_tokenizers_uses_their_own_parser(tmp_path):
    wrapper = scripted_tokenizer(tmp_path, "{{ m.content }}{% for c in m.tool_calls %}<tool_call>\\n<function="
                                           "{{ c.function.name }}>{% endfor %}", WORDS)
    fmt = ReplyFormat.of(wrapper)
    assert wrapper.tool_parser is qwen3_coder.parse_tool_call  # mlx-lm inferred it: reused as is
    assert fmt.tool_parser is qwen3_coder.parse_tool_call and fmt.tool_format == "qwen3_coder"
    assert ReplyFormat.of(wrapper) is fmt  # read once per tokenizer


def test_format_of_a_converted_gguf_tokenizer(tmp_path):
    """GGUF tokenizers (rebuilt by `convert`) keep the template and the marker tokens, so the format is found."""
    from mlx_dflash.convert import gguf_tokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 3, 4, 4, 4, 4], "tokenizer.ggml.eos_token_id": 3,
            "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% for tool_call in m.tool_calls %}"
                                       "<tool_call>{{ tool_call.name }}</tool_call>{% endfor %}{% endfor %}"}
    gguf_tokenizer.write_tokenizer(*gguf_tokenizer.build_tokenizer(meta, "test"), tmp_path)
    wrapper = load_tokenizer(tmp_path)
    fmt = ReplyFormat.of(wrapper)
    assert (fmt.think_start, fmt.think_end, fmt.tool_start, fmt.tool_format) == (
        "<think>", "</think>", "<tool_call>", "json_tools")
    detokenizer = wrapper.detokenizer
    for token in wrapper.encode("<think>ab</think>b<tool_call>a</tool_call>", add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.finalize()
    parser = ReplyParser(fmt, tools=TOOLS)
    assert normal(parser.feed(detokenizer.text) + parser.finish()) == [
        ("reasoning", "ab"), ("text", "b<tool_call>a</tool_call>")]  # markers read; no call in that markup


# -- through the server --------------------------------------------------------------------------
THINK = "<think>\nThe user wants the weather in Paris.\n</think>\n\n"
PREAMBLE = "Let me check."
CALL = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
OPENED = "Still thinking.\n</think>\n\n"
ANSWER = "It is sunny in Paris."
WORDS = ["\n", THINK, PREAMBLE, CALL, CALL2, OPENED, ANSWER]  # whole-string tokens, "\n" too
# A Qwen3-like template: tools listed, earlier thinking and calls as <think> and <tool_call> JSON, thinking
# opened by the prompt when asked (enable_thinking), a different generation prompt after a tool result.
TEMPLATE = (
    "{%- if tools %}<s>tools:{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<a>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}</s>"
    "{%- elif m.role == 'tool' %}<t>{{ m.content }}</s>"
    "{%- else %}<{{ m.role[0] }}>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{% if messages[-1].role == 'tool' %}R={% elif enable_thinking %}A:<think>\n"
    "{% else %}A:{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A scripted target (scripted.py): 'A:' -> thinking, a preamble and two calls; 'A:<think>\\n' -> the
    rest of a thought, then the answer; 'R=' (after a tool result) -> the answer."""
    script = [(":", THINK), (THINK, PREAMBLE), (PREAMBLE, CALL), (CALL, CALL2), (CALL2, "</s>"),
              ("\n", OPENED), (OPENED, ANSWER), ("=", ANSWER), (ANSWER, "</s>")]
    return scripted_pair(tmp_path_factory.mktemp("reply"), template=TEMPLATE, strings=WORDS, script=script)


@pytest.fixture(scope="module")
def server(pair):
    with LiveServer(*pair) as live:
        yield live


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_ID, "messages": QUESTION, "max_tokens": 16, **body})


def test_chat_reply_holds_reasoning_content_and_tool_calls(server):
    reply = chat(server, tools=[WEATHER, TIME])
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather in Paris."
    assert message["content"] == PREAMBLE
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"zone": "CET"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def test_chat_stream_sends_reasoning_content_and_each_call_as_it_completes(server):
    client = openai_client(server)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=[WEATHER, TIME],
                                                 max_tokens=16, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = []
    for d in deltas:
        extra = d.model_extra or {}
        kind = ("reasoning" if extra.get("reasoning_content") else "content" if d.content else
                "call" if d.tool_calls else None)
        if kind and (not kinds or kinds[-1] != kind or kind == "call"):
            kinds.append(kind)
    assert kinds == ["reasoning", "content", "call", "call"]  # one chunk per call
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The user wants the weather in Paris."
    assert "".join(d.content or "" for d in deltas) == PREAMBLE
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.type, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "function", "get_weather", {"city": "Paris"}), (1, "function", "get_time", {"zone": "CET"})]
    assert all(tc.id.startswith("call_") for tc in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_opened_by_the_prompt_and_a_plain_answer(server):
    body = {"chat_template_kwargs": {"enable_thinking": True}}
    message = chat(server, **body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Still thinking.", ANSWER)
    assert "tool_calls" not in message
    lines = [json.loads(line[6:]) for line in httpx.post(
        server.url + "/v1/chat/completions", timeout=60,
        json={"model": MODEL_ID, "messages": QUESTION, "max_tokens": 16, "stream": True, **body}
    ).text.splitlines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["delta"] for c in lines if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in streamed) == "Still thinking."
    assert "".join(d.get("content") or "" for d in streamed) == ANSWER
    assert lines[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_required_or_named_is_constrained_none_keeps_markup_as_text(server):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = chat(server, tools=[WEATHER], tool_choice=choice)
        assert forced.status_code == 200, forced.text
        # Decoded under the call grammar (test_server_tool_choice.py), never as 'auto': no thinking, no preamble.
        message = forced.json()["choices"][0]["message"]
        assert "reasoning_content" not in message and PREAMBLE not in (message["content"] or "")
    assert chat(server, tools=[WEATHER], tool_choice="auto").json()["choices"][0]["finish_reason"] == "tool_calls"
    plain = chat(server, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
    assert plain["message"]["content"] == PREAMBLE + CALL + CALL2
    assert plain["message"]["reasoning_content"] == "The user wants the weather in Paris."


def test_greedy_reply_is_the_targets_own(pair, server):
    model, tokenizer, _ = pair
    prompt = tokenizer.apply_chat_template(QUESTION, tools=[WEATHER, TIME], add_generation_prompt=True)
    alone = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    assert alone == THINK + PREAMBLE + CALL + CALL2
    raw = httpx.post(server.url + "/v1/completions", timeout=60,
                     json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 16}).json()["choices"][0]
    assert raw["text"] == alone and raw["finish_reason"] == "stop"
    message = chat(server, tools=[WEATHER, TIME]).json()["choices"][0]["message"]
    calls = "".join(f'\n<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}'
                    "\n</tool_call>" for c in message["tool_calls"])
    assert "<think>\n" + message["reasoning_content"] + "\n</think>\n\n" + message["content"] + calls == alone


def test_tool_round_trip_answers_after_the_result(server):
    client = openai_client(server)
    first = client.chat.completions.create(model=MODEL_ID, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=16)
    message = first.choices[0].message
    history = QUESTION + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls]
    second = client.chat.completions.create(model=MODEL_ID, messages=history, tools=[WEATHER, TIME], max_tokens=16)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
