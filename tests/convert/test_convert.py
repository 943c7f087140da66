"""Round trips from real PyTorch-format checkpoints (transformers, random init) through `convert`.

Each checkpoint is written by transformers/torch in the test; the converted MLX
directory must give the same logits as PyTorch (fp32 tolerance), 8-bit
quantization the same greedy tokens, and a z-lab drafter must load.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import write_tokenizer
from mlx.utils import tree_flatten
from mlx_dflash.convert import ConvertOptions, convert

from mlx_dflash import load_drafter
from mlx_dflash.loading.loaders import load_target
from mlx_dflash.targets.model import TargetModel

torch = pytest.importorskip("torch", reason="round trips need the torch extra: pip install torch==2.13.0")
transformers = pytest.importorskip("transformers")

VOCAB = 128
PROMPT = [5, 17, 40, 33, 90, 12, 64, 7]
ROPE_THETA = 50_000.0  # not mlx-lm's fallback 10000: a dropped rope_theta changes the logits


def hf_model(model_type: str, seed: int = 0):
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config}[model_type]
    config = cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=ROPE_THETA,
        tie_word_embeddings=model_type != "llama", initializer_range=0.25, eos_token_id=2, bos_token_id=1,
        **({"head_dim": 16} if model_type == "qwen3" else {}),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from exactly one, so a dropped norm weight would show
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf(model, path: Path, fmt: str) -> Path:
    """fmt: "safetensors", "sharded" (several safetensors files + index) or "bin" (PyTorch pickle)."""
    if fmt == "bin":
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        model.save_pretrained(path, max_shard_size="60KB" if fmt == "sharded" else "5GB")
    write_tokenizer(path, VOCAB)
    return path


def torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def torch_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def mlx_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def mlx_greedy(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    return seq[len(ids):]


@pytest.mark.parametrize("model_type,fmt", [("qwen3", "safetensors"), ("llama", "sharded"), ("qwen2", "bin")])
def test_target_round_trip_matches_pytorch(tmp_path, model_type, fmt):
    hf = hf_model(model_type)
    src = save_hf(hf, tmp_path / "hf", fmt)
    if fmt == "sharded":
        assert len(list(src.glob("*.safetensors"))) > 1 and (src / "model.safetensors.index.json").exists()
    raw = json.loads((src / "config.json").read_text())
    assert "rope_theta" not in raw, "transformers 5 nests rope_theta; the test relies on that"
    result = convert(src, tmp_path / "mlx", ConvertOptions(dtype="float32"))
    config = json.loads((result.path / "config.json").read_text())
    assert config["rope_theta"] == ROPE_THETA and "rope_parameters" not in config
    assert config["mlx_dflash"]["source"] == str(src.absolute())
    model, tokenizer = load_target(result.path)
    assert tokenizer.chat_template  # tokenizer and template travel with the weights
    expected = torch_logits(hf, PROMPT)
    np.testing.assert_allclose(mlx_logits(model, PROMPT), expected, rtol=1e-4, atol=1e-4)


# Stated tolerances, as fractions of the reference logits' standard deviation: (mean, max) |error|.
# 8 bit: each weight within ~0.6% of its group's range, compounding over ~20 matmuls of this 3-layer model.
TOLERANCE = {8: (0.04, 0.25), 4: (0.5, 3.0)}


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_target_stays_close(tmp_path, bits):
    hf = hf_model("llama", seed=3)
    src = save_hf(hf, tmp_path / "hf", "safetensors")
    opts = ConvertOptions(dtype="float32", quantize=True, q_bits=bits, q_group_size=32)
    result = convert(src, tmp_path / "mlx", opts)
    config = json.loads((result.path / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    # The mixed recipe keeps the vocabulary matrices at 8 bits.
    if bits < 8:
        assert config["quantization"]["lm_head"]["bits"] == 8
        assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    model, _ = load_target(result.path)
    assert model.model.layers[0].mlp.up_proj.bits == bits  # really quantized, not silently dense
    expected = torch_logits(hf, PROMPT)
    error = np.abs(mlx_logits(model, PROMPT) - expected) / expected.std()
    mean_tol, max_tol = TOLERANCE[bits]
    assert error.mean() <= mean_tol and error.max() <= max_tol, (error.mean(), error.max())
    assert error.mean() > 1e-4  # quantization did change the weights
    if bits == 8:
        assert mlx_greedy(model, PROMPT, 12) == torch_greedy(hf, PROMPT, 12)


def zlab_drafter_checkpoint(path: Path, target_hidden: int = 64, num_layers: int = 2,
                            rope_parameters: bool = True) -> tuple[Path, dict]:
    """A DFlash drafter in the z-lab layout, written with safetensors from torch tensors."""
    from safetensors.torch import save_file

    hidden, heads, kv, head_dim, inter = target_hidden, 4, 2, 16, 96
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2]}, "num_target_layers": 3,
        "num_hidden_layers": num_layers, "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "vocab_size": VOCAB, "dtype": "bfloat16",
        "layer_types": ["full_attention"] * num_layers,
    }
    config.update({"rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"}} if rope_parameters
                  else {"rope_theta": ROPE_THETA})
    g = torch.Generator().manual_seed(7)
    shapes = {"fc.weight": (hidden, 2 * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    tensors = {k: (torch.randn(s, generator=g) * 0.1 + (1.0 if len(s) == 1 else 0.0)).to(torch.bfloat16)
               for k, s in shapes.items()}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path, tensors


def test_drafter_round_trip_loads_with_load_drafter(tmp_path):
    src, tensors = zlab_drafter_checkpoint(tmp_path / "drafter")
    target_src = save_hf(hf_model("qwen3"), tmp_path / "target_hf", "safetensors")
    target_dir = convert(target_src, tmp_path / "target", ConvertOptions(dtype="float32")).path
    result = convert(src, tmp_path / "out", ConvertOptions(dtype="float32"), target=target_dir)
    assert result.kind == "drafter"
    model, _ = load_target(target_dir)
    drafter = load_drafter(result.path, TargetModel(model))
    assert drafter.args.rope_theta == ROPE_THETA
    params = dict(tree_flatten(drafter.parameters()))
    assert set(params) == set(tensors)
    for key, t in tensors.items():
        np.testing.assert_array_equal(np.array(params[key]), t.float().numpy())  # bf16 -> fp32 is exact


def test_quantized_drafter_keeps_fc_dense(tmp_path):
    src, tensors = zlab_drafter_checkpoint(tmp_path / "drafter")
    opts = ConvertOptions(dtype="float32", quantize=True, q_bits=8, q_group_size=32)
    result = convert(src, tmp_path / "out", opts)
    drafter = load_drafter(result.path)
    assert not hasattr(drafter.fc, "scales"), "the mixed recipe keeps the drafter's fc unquantized"
    q = drafter.layers[0].self_attn.q_proj
    assert q.bits == 8
    w = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=8)
    ref = tensors["layers.0.self_attn.q_proj.weight"].float().numpy()
    assert np.abs(np.array(w) - ref).max() <= 0.01 * np.abs(ref).max()  # 8-bit: within 1% of the range
