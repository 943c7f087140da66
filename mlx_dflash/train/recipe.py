"""The training recipe's definitions, free of any framework, shared by the MLX and PyTorch trainers.

Loss weights by block position, the learning-rate schedule, the feature-scale
floor and the z-lab config.json of a trained drafter: one definition each, so
the two trainers cannot drift apart.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_LR = 6e-4  # peak learning rate
# gamma by block size, as published; other sizes use block_size / 2.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# Training sequences whose target features set the per-channel feature scale.
SCALE_EXAMPLES = 8
# A feature channel that is (nearly) always zero keeps a unit scale rather than an enormous gain.
MIN_SCALE = 1e-3


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, block_size / 2)


def position_weight_values(block_size: int, gamma: float | None = None) -> list[float]:
    """Weights exp(-(k - 1) / gamma) of block positions k = 1..block_size-1: an early miss ends acceptance."""
    g = default_gamma(block_size) if gamma is None else gamma
    return [math.exp(-(k - 1) / g) for k in range(1, block_size)]


def warmup_steps(steps: int, warmup: float) -> int:
    return max(1, round(warmup * steps))


def learning_rate(step: int, *, lr: float, steps: int, warmup: float, min_lr_ratio: float) -> float:
    """The rate of optimizer step `step` (0-based): linear warm-up from lr / warmup_steps, then cosine to the floor."""
    w = warmup_steps(steps, warmup)
    if step < w:
        return lr / w + min(step, w) * (lr - lr / w) / w
    decay_steps = max(1, steps - w)
    s = min(step - w, decay_steps)
    end = lr * min_lr_ratio
    return end + 0.5 * (1.0 + math.cos(math.pi * s / decay_steps)) * (lr - end)


def drafter_config(args: Any, dtype: str = "float32") -> dict[str, Any]:
    """The z-lab config.json of a drafter whose ModelArgs (or an object with the same fields) are `args`."""
    n = args.num_hidden_layers
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": args.block_size,
        "dflash_config": {
            "mask_token_id": args.mask_token_id,
            "target_layer_ids": list(args.target_layer_ids),
            "block_size": args.block_size,
        },
        "num_target_layers": args.num_target_layers,
        "num_hidden_layers": n,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "layer_types": ["full_attention"] * n,
        "sliding_window": None,
        "use_sliding_window": False,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "rms_norm_eps": args.rms_norm_eps,
        "max_position_embeddings": args.max_position_embeddings,
        "attention_bias": args.attention_bias,
        "tie_word_embeddings": True,
        "vocab_size": args.vocab_size,
        "dtype": dtype,
    }
