"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library alone (no torch, no transformers).

GGUF keeps llama.cpp's tokenizer description as metadata: the vocabulary, merges (BPE) or
scores (SentencePiece), token types, special token ids, the pre-tokenizer type and the chat
template. Two vocabulary kinds cover the architectures we convert:
- `gpt2`: byte-level BPE; the pre-tokenizer type names the split pattern the merges were learned on;
- `llama`: SentencePiece BPE with byte fallback; merges are recovered from the scores.
Control tokens become special added tokens and user-defined ones plain added tokens, so they are
matched whole in text, as llama.cpp does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mlx_dflash.errors import DFlashError

# llama.cpp token types (llama-vocab.h).
CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer types whose merges were learned with every digit split off first (llama.cpp's
# llama-vocab.cpp), then GPT-2's split pattern.
DIGIT_SPLITTING_PRE = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"})
GPT2_PRE = frozenset({"default", "gpt2", "gpt-2"})
# Llama 3's and Qwen 2's split patterns: contractions, letters with one leading non-letter, digits
# (up to three at a time for Llama 3, one for Qwen 2), punctuation runs, newlines, spaces.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
SPLIT_PATTERNS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_PATTERN),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_PATTERN),
}
SUPPORTED_MODELS = ("gpt2", "llama")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes as themselves, the rest shifted past 255."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _as_list(value: Any) -> list[Any]:
    """A metadata array (list, numpy or mx array) as a Python list."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _as_scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, where: str) -> Tokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token with a character outside the byte alphabet is stored raw by some converters: respell it.
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    if pre in DIGIT_SPLITTING_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in SPLIT_PATTERNS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERNS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in GPT2_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        known = sorted(GPT2_PRE | DIGIT_SPLITTING_PRE | set(SPLIT_PATTERNS))
        raise DFlashError(f"{where}: unsupported GGUF pre-tokenizer type '{pre}' "
                          f"(token ids would differ from the model's); supported: {', '.join(known)}")
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's: every split of a token into two vocabulary pieces, best score first.

    Ties keep a deterministic order: shorter left, then right pieces last; within one token,
    pieces by vocabulary index.
    """
    index = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in index and token[k:] in index]
        splits.sort(key=lambda pair: (index[pair[0]], index[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unk: str | None,
                       add_space_prefix: bool) -> Tokenizer:
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores), dropout=None,
                                     unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None,
                    add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    head = [f"{bos}:0"] if add_bos else []
    tail = [f"{eos}:0"] if add_eos else []
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos and eos != bos else [])
    return processors.TemplateProcessing(
        single=" ".join([*head, "$A:0", *tail]),
        pair=" ".join([*head, "$A:0", *tail, *[t.replace(":0", ":1") for t in head], "$B:1",
                       *[t.replace(":0", ":1") for t in tail]]),
        special_tokens=special,
    )


def build_tokenizer(meta: dict[str, Any], where: str) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer described by GGUF metadata and its `tokenizer_config.json` fields."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise DFlashError(f"{where}: GGUF metadata has no tokenizer (tokenizer.ggml.model)")
    kind = str(kind)
    if kind not in SUPPORTED_MODELS:
        raise DFlashError(f"{where}: unsupported GGUF tokenizer model type '{kind}' "
                          f"(supported: {', '.join(SUPPORTED_MODELS)})")
    if "tokenizer.ggml.tokens" not in meta:
        raise DFlashError(f"{where}: GGUF metadata has no vocabulary (tokenizer.ggml.tokens)")
    tokens = [str(t) for t in _as_list(meta["tokenizer.ggml.tokens"])]
    types = _as_list(meta.get("tokenizer.ggml.token_type", []))

    def special(name: str) -> tuple[str | None, int | None]:
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is None:
            return None, None
        token_id = int(_as_scalar(token_id))
        if not 0 <= token_id < len(tokens):
            raise DFlashError(f"{where}: GGUF {name} token id {token_id} is outside the vocabulary")
        return tokens[token_id], token_id

    (bos, bos_id), (eos, eos_id) = special("bos"), special("eos")
    (unk, _), (pad, _) = special("unknown"), special("padding")
    add_space_prefix = bool(_as_scalar(meta.get("tokenizer.ggml.add_space_prefix", True)))
    if kind == "gpt2":
        if "tokenizer.ggml.merges" not in meta:
            raise DFlashError(f"{where}: GGUF BPE vocabulary has no merges (tokenizer.ggml.merges)")
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        tokenizer = _byte_level_bpe(tokens, [str(m) for m in _as_list(meta["tokenizer.ggml.merges"])], pre, where)
        add_bos_default = False
    else:
        if "tokenizer.ggml.scores" not in meta:
            raise DFlashError(f"{where}: GGUF SentencePiece vocabulary has no scores (tokenizer.ggml.scores)")
        scores = [float(s) for s in _as_list(meta["tokenizer.ggml.scores"])]
        tokenizer = _sentencepiece_bpe(tokens, scores, unk, add_space_prefix)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = bool(_as_scalar(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)))
    add_eos = bool(_as_scalar(meta.get("tokenizer.ggml.add_eos_token", False)))

    # Control tokens (and the named special ones) are matched whole and never split; in a byte-level
    # vocabulary a "control" token spelled outside the byte alphabet is a mislabel and stays out.
    alphabet = set(_byte_alphabet().values()) if kind == "gpt2" else None
    named = {t for t in (bos, eos, unk, pad) if t is not None}
    controls = [t for t, ty in zip(tokens, types, strict=False)
                if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    specials = list(dict.fromkeys([*controls, *sorted(named - set(controls), key=tokens.index)]))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED and t not in named]
    if user:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tokenizer.post_processor = _post_processor(bos, bos_id, eos, eos_id, add_bos, add_eos)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return tokenizer, {k: v for k, v in config.items() if v is not None}


def write_tokenizer(tokenizer: Tokenizer, config: dict[str, Any], out_dir: Path) -> None:
    """`tokenizer.json` and `tokenizer_config.json`, as transformers (and so mlx-lm) load them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
