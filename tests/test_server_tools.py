"""Tool calls through the server (OpenAI tool_calls, Anthropic tool_use), with the stop-string
and tool-markup filter and the `<tool_call>` parser tested on their own."""

from __future__ import annotations

import json

import anthropic
import mlx.core as mx
import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from serverkit import MODEL_ID, LiveServer
from tiny import EOS_ID, tiny_drafter, tiny_target

from mlx_dflash.server.text import TextFilter
from mlx_dflash.server.tools import parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
# A Qwen3/Hermes-like template: tools listed, earlier calls as <tool_call> JSON, tool results,
# and a generation prompt that ends differently after a tool result.
TEMPLATE = (
    "{%- if greeting is defined %}{{ greeting }}{% endif %}"
    "{%- if tools %}<s>tools:{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<a>{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}</s>"
    "{%- elif m.role == 'tool' %}<t>{{ m.content }}</s>"
    "{%- else %}<{{ m.role[0] }}>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{% if messages[-1].role == 'tool' %}R={% else %}A:{% endif %}{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def scripted_pair(path):
    """A target whose next token depends on the last one only: 'A:' -> a tool call, 'R=' -> an answer.

    Characters are tokens, plus two whole-string tokens (the call and the answer), so the
    reply is fixed while decoding still runs the real target and a (random) DFlash drafter.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<s>", "</s>", "<mask>"] + [chr(c) for c in range(32, 127)] + [CALL, ANSWER]
    table = {tok: i for i, tok in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   mask_token="<mask>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    tokenizer = load_tokenizer(path, eos_token_ids=[EOS_ID])

    model = tiny_target("llama", seed=9, vocab=len(vocab))
    for layer in model.model.layers:  # no mixing: the last position sees its own embedding only
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    embed = model.model.embed_tokens.weight
    head = mx.zeros((len(vocab), embed.shape[1]))
    for src, dst in ((":", CALL), (CALL, "</s>"), ("=", ANSWER), (ANSWER, "</s>")):
        h = model.model.norm(embed[table[src]])
        head[table[dst]] = head[table[dst]] + 50.0 * h / (h * h).sum()
    model.lm_head.weight = head
    mx.eval(model.parameters())
    return model, tokenizer, tiny_drafter(model, block_size=4)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(*scripted_pair(tmp_path_factory.mktemp("tools"))) as live:
        yield live


def test_openai_tool_round_trip(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER], max_tokens=16)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER],
                                                 max_tokens=16, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # no markup streamed as text
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = question + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = client.chat.completions.create(model=MODEL_ID, messages=history, tools=[WEATHER], max_tokens=16)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"

    plain = client.chat.completions.create(model=MODEL_ID, messages=question, tools=[WEATHER], tool_choice="none",
                                           max_tokens=16)
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls


def test_anthropic_tool_use_round_trip(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Weather in a city",
              "input_schema": WEATHER["function"]["parameters"]}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL_ID, max_tokens=16, tools=tools, messages=question)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")

    with client.messages.stream(model=MODEL_ID, max_tokens=16, tools=tools, messages=question) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.content[0].input == {"city": "Paris"}

    history = question + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}]},
    ]
    second = client.messages.create(model=MODEL_ID, max_tokens=16, tools=tools, messages=history)
    assert second.content[0].text == ANSWER and second.stop_reason == "end_turn"


def test_filter_holds_back_a_stop_string_split_across_pushes():
    text = TextFilter(["END"])
    assert text.push("abcE").text == "abc"
    assert text.push("N").text == ""
    released = text.push("Dxyz")
    assert released.text == "" and released.stop == "END"
    assert text.released == "abc"


def test_filter_releases_a_false_start():
    text = TextFilter(["END"])
    assert text.push("abE").text == "ab"
    assert text.push("Nx").text == "ENx"
    assert text.flush() == "" and text.released == "abENx"
    held = TextFilter(["END"])
    held.push("zzEN")
    assert held.flush() == "EN"  # generation ended: what was held back was no stop string


def test_filter_diverts_tool_markup():
    text = TextFilter(["STOP"], capture_marker="<tool_call>")
    assert text.push("Sure. <tool").text == "Sure. "
    released = text.push('_call>{"name": "f"}</tool_call>')
    assert released.captured and released.text == ""
    assert text.captured == '{"name": "f"}</tool_call>'


def test_parse_tool_calls():
    calls = parse_tool_calls('\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                             '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert parse_tool_calls('{"name": "a", "arguments": {"x": 1}') is None  # cut short: not a call
    assert parse_tool_calls("not json</tool_call>") is None


def test_chat_template_kwargs_reach_the_template(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    question = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=MODEL_ID, messages=question, max_tokens=2)
    greeted = client.chat.completions.create(model=MODEL_ID, messages=question, max_tokens=2,
                                             extra_body={"chat_template_kwargs": {"greeting": "Hello!"}})
    assert greeted.usage.prompt_tokens == plain.usage.prompt_tokens + len("Hello!")
