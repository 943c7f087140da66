"""The DFlash draft model (z-lab v1 checkpoint layout).

A few Qwen3-style layers whose queries come from the draft block only and
whose keys/values come from the target's fused hidden features (the context)
and from the block, attended without a causal mask. Parameter names equal the
published safetensors keys, so loading is `load_weights`. The drafter owns no
embedding and no lm_head: it borrows the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels

if TYPE_CHECKING:
    from .draft_cache import DraftContextCache

DEFAULT_BLOCK_SIZE = 16


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule for picking target layers when the config has none."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    model_type: str = "qwen3"
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    block_size: int | None = None
    dflash_config: dict[str, Any] = field(default_factory=dict)
    num_target_layers: int | None = None
    tie_word_embeddings: bool = True
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    quantization: dict[str, Any] | None = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # transformers >= 5 nests rope settings under `rope_parameters`.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            rope_type = self.rope_parameters.get("rope_type", "default")
            if self.rope_scaling is None and rope_type != "default":
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 1_000_000.0
        if self.block_size is None:
            self.block_size = self.dflash_config.get("block_size", DEFAULT_BLOCK_SIZE)
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types lists {len(self.layer_types)} layers, num_hidden_layers is {self.num_hidden_layers}"
            )
        if "sliding_attention" in (self.layer_types or []) and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")

    @property
    def mask_token_id(self) -> int:
        if "mask_token_id" not in self.dflash_config:
            raise ValueError("drafter config has no dflash_config.mask_token_id")
        return int(self.dflash_config["mask_token_id"])

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if ids is not None:
            return [int(i) for i in ids]
        if self.num_target_layers is None:
            raise ValueError(
                "drafter config has neither dflash_config.target_layer_ids nor "
                "num_target_layers; call resolve_target_layers(n) with the target's depth"
            )
        return default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    @property
    def layer_windows(self) -> list[int | None]:
        """Per draft layer: the context window of a sliding-attention layer, else None."""
        types = self.layer_types or ["full_attention"] * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    def resolve_target_layers(self, num_target_layers: int) -> None:
        """Fill in the default target layers from the target's depth when absent."""
        if self.dflash_config.get("target_layer_ids") is None:
            if self.num_target_layers is None:
                self.num_target_layers = num_target_layers
            self.dflash_config["target_layer_ids"] = default_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.scale = head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)

    def __call__(
        self, x: mx.array, rope: nn.Module, position: int | mx.array, cache: DraftContextCache, layer: int,
        mask: mx.array | None = None,
    ) -> mx.array:
        """`mask` (L, span) limits what each block query sees (DFlash2 layers); v1 passes none.
        `position`: the block's first position, or one per row (B,) for a batch (`RaggedDraftCache`)."""
        B, L, _ = x.shape
        backend = kernels.backend() if isinstance(position, int) else None  # the kernel takes one offset
        tables = kernels.rope_tables(rope, self.q_norm.weight.shape[0]) if backend else None
        if tables is not None:
            # One launch for both norms, both RoPEs and the attention layout.
            q, k = kernels.prepare_block_qk(
                q=self.q_proj(x), k=self.k_proj(x), q_norm_weight=self.q_norm.weight,
                k_norm_weight=self.k_norm.weight, q_eps=self.q_norm.eps, k_eps=self.k_norm.eps,
                tables=tables, offset=position, num_heads=self.n_heads, num_kv_heads=self.n_kv_heads,
                backend=backend,
            )
        else:
            q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
            k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            q = rope(q, offset=position)
            k = rope(k, offset=position)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        # The block's K/V are written after the cached context, in place, and the
        # whole span is attended non-causally: every block position sees everything.
        keys, values = cache.attend_span(layer, k, v)
        if mask is None:
            mask = cache.span_mask(layer, L)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self, x: mx.array, rope: nn.Module, position: int | mx.array, cache: DraftContextCache, layer: int
    ) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), rope, position, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        num_features = len(args.target_layer_ids) * args.hidden_size
        self.fc = nn.Linear(num_features, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # All draft layers share one rotary embedding (same config everywhere).
        self.rope = initialize_rope(
            args.head_dim,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids

    def fuse_context(self, target_hidden: mx.array) -> mx.array:
        """Concatenated target-layer features (B, n, k*D) -> context features (B, n, D)."""
        return self.hidden_norm(self.fc(target_hidden))

    def __call__(
        self, block_embeddings: mx.array, cache: DraftContextCache, position: int | mx.array
    ) -> mx.array:
        """Run the draft layers on a block starting at absolute `position` (per row for a batch).

        Returns the final-normed hidden states (B, L, D); the caller applies the
        target's lm_head. The cache must already hold the context K/V.
        """
        h = block_embeddings
        for i, layer in enumerate(self.layers):
            h = layer(h, self.rope, position, cache, i)
        return self.norm(h)

    def quantize_packed(self, weights: dict[str, mx.array]) -> None:
        """Quantize, as the config's `quantization` block says, each layer `weights` holds packed."""
        q = self.args.quantization
        if q:
            nn.quantize(self, group_size=q["group_size"], bits=q["bits"],
                        class_predicate=lambda path, m: hasattr(m, "to_quantized") and f"{path}.scales" in weights)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Some exports prefix keys with `model.`; the embedding and lm_head, if a
        # checkpoint carries them, belong to the target and are dropped.
        out = {}
        for key, value in weights.items():
            if key.startswith("model."):
                key = key[len("model.") :]
            if key.startswith(("embed_tokens.", "lm_head.")) or "rotary_emb" in key:
                continue
            out[key] = value
        return out
