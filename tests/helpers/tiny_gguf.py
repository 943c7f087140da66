"""Tiny GGUF files for tests: a one-layer llama with random float32 weights and a given tokenizer.

The tokenizer can be a SentencePiece BPE model trained in the test on real text (the way
llama.cpp's converter writes SentencePiece vocabularies), or raw metadata to break on purpose.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, HEADS, FFN = 16, 2, 32
# sentencepiece token kinds -> llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def train_sentencepiece(texts: Iterable[str], vocab_size: int = 800, user_defined: tuple[str, ...] = ("<think>",),
                        control: tuple[str, ...] = ("<ctrl>",)) -> Any:
    """A SentencePiece BPE model with byte fallback and no normalisation (so its ids are checkable)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=list(user_defined), control_symbols=list(control), minloglevel=2, num_threads=1,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_metadata(sp: Any, user_defined: tuple[str, ...] = ("<think>",)) -> dict[str, Any]:
    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        if sp.is_control(i):
            return CONTROL
        if sp.is_byte(i):
            return BYTE
        if sp.is_unused(i):
            return UNUSED
        return USER_DEFINED if sp.id_to_piece(i) in user_defined else NORMAL

    n = sp.get_piece_size()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.chat_template": "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}",
    }


def write_llama_gguf(path: Path, tokenizer: dict[str, Any], vocab_size: int, seed: int = 0) -> Path:
    """A complete one-layer llama GGUF with `tokenizer` as its tokenizer metadata."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    for key, value in tokenizer.items():
        name = key.removeprefix("tokenizer.ggml.")
        if key == "tokenizer.chat_template":
            writer.add_chat_template(value)
        elif name == "model":
            writer.add_tokenizer_model(value)
        elif name == "tokens":
            writer.add_token_list(value)
        elif name == "scores":
            writer.add_token_scores(value)
        elif name == "token_type":
            writer.add_token_types(value)
        elif name == "merges":
            writer.add_token_merges(value)
        elif name == "pre":
            writer.add_tokenizer_pre(value)
        elif name.endswith("_token_id"):
            writer.add_uint32(key, int(value))
        else:
            raise ValueError(f"tiny_gguf: no writer for {key}")

    def tensor(name: str, *shape: int) -> None:
        scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", vocab_size, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    for part, shape in {"attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,), "attn_q": (HIDDEN, HIDDEN),
                        "attn_k": (HIDDEN, HIDDEN), "attn_v": (HIDDEN, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                        "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}.items():
        tensor(f"blk.0.{part}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
