"""Tiny random models, tokenizers and proposers for tests (fp32, seconds to build)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import _get_classes

from mlx_dflash import stream_generate
from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs
from mlx_dflash.targets.model import TargetModel

VOCAB = 128  # ids 0..3 are special, the rest printable ASCII
EOS_ID = 2
HIDDEN = 64

FAMILY_CONFIGS = {
    "qwen3": dict(head_dim=16, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen3_moe": dict(
        head_dim=16, tie_word_embeddings=False, rope_theta=10000.0, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True,
    ),
    "llama": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "mistral": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=10000.0),
}


def target_config(model_type: str, num_layers: int = 4, vocab: int = VOCAB) -> dict:
    return dict(
        model_type=model_type, hidden_size=HIDDEN, num_hidden_layers=num_layers,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, vocab_size=vocab, max_position_embeddings=4096,
        **FAMILY_CONFIGS[model_type],
    )


def _randomize(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    rng = np.random.default_rng(seed)

    def fill(p: mx.array) -> mx.array:
        if p.ndim == 1:  # norms: around one, not exactly one, so their weights matter
            return mx.array(1.0 + 0.1 * rng.standard_normal(p.shape), dtype=mx.float32)
        fan_in = p.shape[-1]
        return mx.array(scale * rng.standard_normal(p.shape) / np.sqrt(fan_in), dtype=mx.float32)

    model.update(tree_map(fill, model.parameters()))
    mx.eval(model.parameters())


def tiny_target(model_type: str = "qwen3", seed: int = 0, num_layers: int = 4,
                vocab: int = VOCAB) -> nn.Module:
    config = target_config(model_type, num_layers, vocab)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    # A larger weight scale makes the tiny model's logits decisive (few near-ties).
    _randomize(model, seed, scale=2.0)
    return model


def drafter_config(target: nn.Module, num_layers: int = 2, block_size: int = 8,
                   target_layer_ids: list[int] | None = None, mask_token_id: int = 3) -> dict:
    t = TargetModel(target)
    ids = target_layer_ids if target_layer_ids is not None else [1, t.num_layers - 2]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
        "num_target_layers": t.num_layers, "num_hidden_layers": num_layers,
        "hidden_size": t.hidden_size, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "rope_scaling": None,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "vocab_size": t.vocab_size, "layer_types": ["full_attention"] * num_layers,
    }


def tiny_drafter(target: nn.Module, seed: int = 1, **kwargs) -> DFlashDraftModel:
    model = DFlashDraftModel(ModelArgs.from_dict(drafter_config(target, **kwargs)))
    _randomize(model, seed)
    return model


def save_drafter(model: DFlashDraftModel, config: dict, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A character-level fast tokenizer with a chat template (no network needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<mask>"]
    chars = [chr(c) for c in range(32, 32 + vocab - len(specials))]
    table = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        mask_token="<mask>",
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    fast.save_pretrained(str(path))


def tiny_tokenizer(path: Path) -> TokenizerWrapper:
    """`write_tokenizer`'s tokenizer written under `path` and loaded as mlx-lm loads one."""
    write_tokenizer(path)
    return load_tokenizer(path, eos_token_ids=[EOS_ID])


def save_target(model: nn.Module, model_type: str, path: Path, num_layers: int = 4) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = target_config(model_type, num_layers, TargetModel(model).vocab_size)
    config["eos_token_id"] = EOS_ID
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    write_tokenizer(path, config["vocab_size"])
    return path


def greedy_reference(model: nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Target-alone greedy decoding with mlx-lm's own generate_step (the ground truth)."""
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=max_tokens):
        out.append(int(token))
    return out


class ScriptedProposer:
    """Proposes from a known continuation: the oracle, corrupted at chosen rates.

    `sequence` is prompt + the target's greedy continuation; a proposal for the
    block after `position` is sequence[position + 1 : ...], each token replaced
    by a wrong one with probability `error_rate` (1.0: always wrong).
    """

    def __init__(self, sequence: list[int], vocab: int, error_rate: float = 0.0, seed: int = 0,
                 target_layer_ids: list[int] | None = None):
        self.sequence = sequence
        self.vocab = vocab
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self.target_layer_ids = target_layer_ids or [0]
        self.committed = 0

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        assert position == self.committed, (position, self.committed)
        out = []
        for k in range(1, block_size):
            i = position + k
            true = self.sequence[i] if i < len(self.sequence) else 0
            wrong = self.rng.random() < self.error_rate
            out.append((true + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
                       if wrong else true)
        return mx.array(out, dtype=mx.uint32)

    def commit(self, features, position: int) -> None:
        assert position == self.committed, (position, self.committed)
        self.committed += features.shape[1] if features is not None else 0

    def trim(self, num_positions: int) -> None:
        self.committed -= num_positions

    def state_arrays(self) -> list:
        return []


class OracleProposer:
    """Proposes the target's own greedy continuation of what was actually committed.

    Unlike ScriptedProposer it follows sampled generations: it rebuilds the
    committed token history from the prompt, the pending tokens it is given and
    its own accepted proposals (a commit of n positions from `position` covers
    the pending token and the first n - 1 proposed tokens). Single-turn only.
    """

    def __init__(self, model: nn.Module, prompt: list[int], target_layer_ids: list[int] | None = None):
        self.model = model
        self.tokens = list(prompt)  # committed tokens, known by value
        self.target_layer_ids = target_layer_ids or [0]
        self.committed = 0
        self.pending: list[int] = []
        self.last_draft: mx.array | None = None  # the latest proposal (tests inspect it)
        self.proposals = 0

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        assert position == self.committed == len(self.tokens), (position, self.committed, len(self.tokens))
        seq = self.tokens + [int(last_token.item())]
        out = []
        for _ in range(block_size - 1):
            logits = self.model(mx.array(seq + out, dtype=mx.uint32)[None])[0, -1]
            out.append(int(mx.argmax(logits).item()))
        self.pending = seq[-1:] + out
        self.last_draft = mx.array(out, dtype=mx.uint32)
        self.proposals += 1
        return self.last_draft

    def commit(self, features, position: int) -> None:
        assert position == self.committed, (position, self.committed)
        n = features.shape[1] if features is not None else 0
        if position + n > len(self.tokens):  # a verify cycle's committed positions
            assert position == len(self.tokens) and n <= len(self.pending)
            self.tokens += self.pending[:n]
        self.committed += n

    def trim(self, num_positions: int) -> None:
        self.committed -= num_positions
        del self.tokens[self.committed:]

    def state_arrays(self) -> list:
        return []


class FakeDetokenizer:
    """mlx-lm's streaming detokenizer interface over a character-level vocabulary."""

    def __init__(self, tokenizer: FakeTokenizer):
        self.tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self.offset = 0

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment = self.text[self.offset :]
        self.offset = len(self.text)
        return segment


class FakeTokenizer:
    """Just what `stream_generate` needs: encode, decode, eos ids and a detokenizer.

    Ids 0..3 are specials (rendered as <i>); id i >= 4 is chr(28 + i), as in
    `tiny.write_tokenizer`.
    """

    def __init__(self, eos_token_ids=(EOS_ID,), vocab: int = VOCAB):
        self.eos_token_ids = set(eos_token_ids)
        self.vocab = vocab

    @property
    def detokenizer(self) -> FakeDetokenizer:
        """A fresh one per caller (as mlx-lm's wrapper gives): a server detokenizes requests side by side."""
        return FakeDetokenizer(self)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 28 for c in text]

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" if i < 4 else chr(28 + i) for i in ids)


def self_reply_chat(root: Path, model_type: str, *, conversations: int, max_tokens: int,
                    sharegpt: bool = False) -> tuple[Path, Path]:
    """A tiny target whose next token depends on the current one, and chat data of its own greedy replies.

    The target's attention outputs are zeroed, so a drafter can learn its continuations in a
    few dozen steps (a random 4-layer target's are close to chaotic at this size). Returns the
    target directory and a gzipped JSONL file (ShareGPT `conversations` or `messages` records).
    """
    import gzip

    from mlx_dflash.generate import generate
    from mlx_dflash.loading.loaders import load_target

    model = tiny_target(model_type, seed=0)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    target_dir = save_target(model, model_type, root / "target")
    model, tokenizer = load_target(target_dir)
    rng = np.random.default_rng(0)
    records = []
    while len(records) < conversations:
        user = "".join(chr(c) for c in rng.integers(97, 123, size=6))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                               add_generation_prompt=True)
        reply = generate(model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False), max_tokens=max_tokens)
        if "<" in reply or len(reply) < 10:  # keep replies free of special-token text
            continue
        if sharegpt:
            records.append({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]})
        else:
            records.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]})
    data = root / "chat.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    return target_dir, data


def adaptive_options() -> dict:
    """Adaptive drafting as the engine spells it: `adaptive=True`, or `block_size="auto"` where that replaced it."""
    return {"adaptive": True} if "adaptive" in inspect.signature(stream_generate).parameters else {"block_size": "auto"}
