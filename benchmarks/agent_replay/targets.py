"""The two targets' model folders: the embedded SmolLM2 pair, and a tiny random Qwen3.5 (the hybrid).

Attention: the embedded SmolLM2-135M-Instruct and its shipped drafter, as `dflash-mlx serve` resolves them.
SmolLM2's chat template leaves tools out, so an agent's prompt would lose its tool definitions (most of it):
`with_tools_template` makes a folder beside it whose files link to the same weights and tokenizer, with a
ChatML template that lists the tools (TOOLS_TEMPLATE, written here), so the prompts have the agents' size.

Hybrid: a random Qwen3.5 (GatedDeltaNet layers, full attention every 4th) saved as an mlx-lm model with a
real tokenizer, SmolLM2's, and the same template, so the server renders real chat templates and counts real
tokens. Random weights are enough: what the prompt cache reuses depends on the cache's kind (recurrent state
cannot be rolled back) and on the prompts, not on what the model says.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ChatML with the tools listed in the system turn and earlier calls and results in Hermes form.
TOOLS_TEMPLATE = (
    "{% set ns = namespace(first=0) %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% set ns.first = 1 %}{% endif %}"
    "# Tools\n\nThese functions can be called; their signatures are in <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "To call one, answer with its name and arguments as JSON inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}{% if loop.index0 >= ns.first %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ '\\n' }}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def text_config(vocab_size: int, layers: int = 8, hidden: int = 256) -> dict:
    """tests/helpers/families.py's Qwen3.5 text config, widened to `hidden`, `layers` deep, full attention every
    4th layer, with the real tokenizer's vocabulary."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.families import _QWEN35_TEXT

    return dict(_QWEN35_TEXT, model_type="qwen3_5_text", hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=hidden // 4,
                linear_value_head_dim=hidden // 4, full_attention_interval=4, vocab_size=vocab_size,
                max_position_embeddings=32768)


def embedded_pair() -> tuple[Path, str | None]:
    """The embedded SmolLM2's converted folder and its shipped drafter, as `dflash-mlx serve` picks them
    (the same resolution as serve_load/server.py's)."""
    from mlx_dflash.loading.resolve import choose_pair

    pair = choose_pair(None, None, False)
    return Path(pair.target), pair.draft


def with_tools_template(source: Path, path: Path) -> Path:
    """A model folder at `path` whose files link to `source`'s, but whose chat template is TOOLS_TEMPLATE."""
    path.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "tokenizer_config.json" and not (path / item.name).exists():
            (path / item.name).symlink_to(item.resolve())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path


def build_hybrid(path: Path, layers: int = 8, hidden: int = 256, seed: int = 0) -> Path:
    """Write the tiny random Qwen3.5 with SmolLM2's tokenizer and TOOLS_TEMPLATE to `path`; the folder."""
    import mlx_dflash  # noqa: F401, I001  (first: on Linux it loads OpenBLAS before mlx.core)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.tiny import _randomize

    source, _ = embedded_pair()
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = {"model_type": "qwen3_5", "text_config": text_config(vocab, layers, hidden),
              "eos_token_id": json.loads((source / "config.json").read_text()).get("eos_token_id", 2)}
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize(model, seed, scale=2.0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    shutil.copy(source / "tokenizer.json", path / "tokenizer.json")
    tok_config["chat_template"] = TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    return path
