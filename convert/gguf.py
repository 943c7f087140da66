"""GGUF targets: weights renamed to Hugging Face names, config and tokenizer rebuilt from metadata.

`mx.load` reads Q4_0/Q4_1/Q8_0 tensors as group-32 packed weights; files it
cannot read (K-quants) are dequantized with the `gguf` package instead. The
tokenizer is rebuilt by `gguf_tokenizer`.
llama.cpp stores llama q/k rows permuted for its rotary layout; that is undone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_dflash.errors import DFlashError

if TYPE_CHECKING:  # MLX is imported where arrays are made: the PyTorch trainer reads GGUF files without it
    import mlx.core as mx

ARCHITECTURES = ("llama", "qwen2", "qwen3")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise DFlashError(f"GGUF metadata has no {key}")
        return default
    value = meta[key]
    return value.item() if hasattr(value, "item") else value


def read_tensors(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    import mlx.core as mx

    try:
        return mx.load(str(path), return_metadata=True)
    except Exception:  # K-quants and other types MLX cannot read: the gguf package dequantizes them
        return _read_with_gguf_package(path)


def _read_with_gguf_package(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    import mlx.core as mx

    tensors, meta = read_dequantized(path)
    return {name: mx.array(value) for name, value in tensors.items()}, meta


def read_dequantized(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every tensor dequantized to float32 numpy arrays (by the `gguf` package), and the metadata."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise DFlashError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0]})") from None
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        try:
            values = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise DFlashError(f"{path}: cannot read tensor {t.name} ({str(e).splitlines()[0]})") from None
        # GGUF lists dimensions innermost first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = np.asarray(values, dtype=np.float32).reshape(shape)
    return tensors, meta


def _unpermute(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's q/k row order (rows of weight, scales and biases alike; MLX or numpy arrays)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], where: str) -> dict[str, Any]:
    arch = str(_scalar(meta, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise DFlashError(f"{where}: unsupported GGUF architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})")
    hidden = int(_scalar(meta, f"{arch}.embedding_length"))
    heads = int(_scalar(meta, f"{arch}.attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, f"{arch}.block_count")),
        "intermediate_size": int(_scalar(meta, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_scalar(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(meta, f"{arch}.context_length", 4096)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for name in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in meta:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(_scalar(meta, key))
    return config


def hf_weights(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """GGUF tensor names -> Hugging Face names; llama q/k rows back in Hugging Face order."""
    out = {}
    for name, value in tensors.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)", name)
        if m:
            layer, part, suffix = m.groups()
            if part not in _LAYER_NAMES:
                raise DFlashError(f"GGUF tensor {name} has no Hugging Face counterpart")
            if config["model_type"] == "llama" and part in ("attn_q", "attn_k"):
                heads = config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
                value = _unpermute(value, heads)
            out[f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"] = value
            continue
        base, _, suffix = name.rpartition(".")
        if base in _TOP_NAMES:
            out[f"{_TOP_NAMES[base]}.{suffix}"] = value
        elif base != "rope_freqs":  # llama.cpp's rope table is recomputed by the model
            raise DFlashError(f"GGUF tensor {name} has no Hugging Face counterpart")
    return out
