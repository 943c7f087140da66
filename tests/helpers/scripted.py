"""A scripted target for the server tests: a tiny real llama target whose next token depends on the last
one only, over a word-level tokenizer (characters as tokens, plus whole-string tokens), so the server's
reply is a fixed string while decoding still runs the real target and a (random) DFlash drafter."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import load as load_tokenizer

from helpers.tiny import EOS_ID, tiny_drafter, tiny_target

# The special tokens (ids 0-3: EOS_ID is "</s>", the drafter's mask token "<mask>") and printable ASCII.
BASE_VOCAB = ["<unk>", "<s>", "</s>", "<mask>"] + [chr(c) for c in range(32, 127)]


def scripted_vocab(strings: Sequence[str]) -> list[str]:
    return BASE_VOCAB + list(strings)


def scripted_tokenizer(path, template: str, strings: Sequence[str]):
    """Characters as tokens, then `strings` as whole-string tokens (only the model emits those), saved
    under `path` with `template` as the chat template and loaded back as mlx-lm's wrapper."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = scripted_vocab(strings)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   mask_token="<mask>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return load_tokenizer(path, eos_token_ids=[EOS_ID])


def scripted_pair(path, *, template: str, strings: Sequence[str], script: Sequence[tuple], seed: int = 9,
                  block_size: int = 4, num_layers: int = 4, context: int | None = None,
                  target_layer_ids: list[int] | None = None):
    """(model, tokenizer, drafter): the model's next token after `src` is `dst`, for each `(src, dst)` or
    `(src, dst, logit)` of `script` (logit 50 unless given; a smaller one makes a second choice).

    `context`: the target's max_position_embeddings where a test needs a long prompt."""
    tokenizer = scripted_tokenizer(path, template, strings)
    vocab = scripted_vocab(strings)
    table = {t: i for i, t in enumerate(vocab)}
    model = tiny_target("llama", seed=seed, num_layers=num_layers, vocab=len(vocab))
    if context is not None:
        model.args.max_position_embeddings = context
    for layer in model.model.layers:  # no mixing: the last position sees its own embedding only
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    embed = model.model.embed_tokens.weight
    head = mx.zeros((len(vocab), embed.shape[1]))
    for src, dst, *logit in script:
        h = model.model.norm(embed[table[src]])
        head[table[dst]] = head[table[dst]] + (logit[0] if logit else 50.0) * h / (h * h).sum()
    model.lm_head.weight = head
    mx.eval(model.parameters())
    return model, tokenizer, tiny_drafter(model, block_size=block_size, target_layer_ids=target_layer_ids)


# A weather tool round trip for the scripted target: 'A:' -> CALL, 'R=' (after a tool result) -> ANSWER.
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


# A Qwen3-like chat template's turns (tools listed, earlier thinking and calls rendered, tool results);
# a test adds its own generation prompt.
QWEN_LIKE_TURNS = (
    "{%- if tools %}<s>tools:{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<a>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}</s>"
    "{%- elif m.role == 'tool' %}<t>{{ m.content }}</s>"
    "{%- else %}<{{ m.role[0] }}>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
)
