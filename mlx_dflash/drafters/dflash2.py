"""The DFlash2 draft model (z-lab `DFlash2DraftModel` checkpoints).

DFlash v1's block drafter (see `dflash.py`, whose attention, MLP, context
injection and draft cache it reuses) with three additions:
- around each sublayer a grouped dynamic causal convolution over the block: one
  on the normed input before the sublayer, one on its output after it, both with
  per-position kernel corrections projected from the normed input;
- per-layer in-block attention rules: `sliding_attention` layers see the context
  within `sliding_window` of each query and are causal inside the block unless
  `is_causal` says otherwise; full layers are bidirectional unless `is_causal`;
- logits = lm_head(h) * output_multiplier, then tanh soft-capping; a candidate
  selector (`selector.py`) picks the drafted path among each position's top-k.
Parameter names equal the checkpoint keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from . import dflash as v1
from .selector import CandidateSelector, Selection

if TYPE_CHECKING:
    from ..targets.model import TargetModel
    from .draft_cache import DraftContextCache

ARCHITECTURE = "DFlash2DraftModel"
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class ModelArgs(v1.ModelArgs):
    is_causal: bool | None = None
    final_logit_softcapping: float | None = None  # some exports keep it at the top level

    def __post_init__(self):
        super().__post_init__()
        for key in _REQUIRED:
            value = self.dflash_config.get(key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DFlash2 drafter config needs a positive integer dflash_config.{key}, got {value!r}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} exceeds the vocabulary of {self.vocab_size}")

    @property
    def conv_kernel_size(self) -> int:
        return int(self.dflash_config["conv_kernel_size"])

    @property
    def conv_group_size(self) -> int:
        return int(self.dflash_config["conv_group_size"])

    @property
    def selector_rank(self) -> int:
        return int(self.dflash_config["selector_rank"])

    @property
    def selector_top_k(self) -> int:
        return int(self.dflash_config["selector_top_k"])

    @property
    def softcap(self) -> float | None:
        cap = self.dflash_config.get("final_logit_softcapping", self.final_logit_softcapping)
        return float(cap) if cap else None

    @property
    def output_multiplier(self) -> float:
        return float(self.dflash_config.get("output_multiplier", 1.0))

    @property
    def input_embedding_scale(self) -> float:
        return float(self.dflash_config.get("input_embedding_scale", 1.0))

    @property
    def layer_types_or_full(self) -> list[str]:
        return self.layer_types or ["full_attention"] * self.num_hidden_layers

    @property
    def layer_windows(self) -> list[int | None]:
        # A block query at p sees context keys in (p - sliding_window, p): at most window - 1 of them.
        return [self.sliding_window - 1 if t == "sliding_attention" else None for t in self.layer_types_or_full]

    def layer_is_causal(self, layer: int) -> bool:
        """In-block causality: `is_causal` (top level or in dflash_config) when set, else sliding layers only."""
        causal = self.is_causal if self.is_causal is not None else self.dflash_config.get("is_causal")
        sliding = self.layer_types_or_full[layer] == "sliding_attention"
        return sliding if causal is None else bool(causal)


def block_mask(context: int, length: int, window: int | None, causal: bool) -> mx.array | None:
    """Which keys of [context; block] each block query sees (None: all of them).

    Query i sits `context + i` positions after the first context key; a sliding
    window keeps context keys closer than `window`, causality keeps block keys <= i.
    """
    if window is None and not causal:
        return None
    query = mx.arange(length)[:, None]
    key = mx.arange(context + length)[None]
    in_context = key < context
    seen_context = in_context if window is None else in_context & (context + query - key < window)
    seen_block = ~in_context if not causal else ~in_context & (key - context <= query)
    return seen_context | seen_block


class GroupedDynamicConv(nn.Module):
    """Causal convolution over the block positions (never across blocks), per channel.

    Tap o of position t weighs x[t - o] by base_kernel[which, o] plus a correction that
    `kernel_projection` predicts from the position's normed input, shared by each group
    of `group_size` channels. `which` 0 is the convolution before the sublayer, 1 after.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def corrections(self, x: mx.array) -> mx.array:
        """(B, L, D) normed input -> (B, L, 2, kernel_size, groups) kernel corrections."""
        B, L, D = x.shape
        return self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, D // self.group_size)

    def __call__(self, x: mx.array, corrections: mx.array, which: int) -> mx.array:
        B, L, D = x.shape
        K, groups = self.kernel_size, D // self.group_size
        grouped = x.reshape(B, L, groups, self.group_size)
        padded = mx.pad(grouped, [(0, 0), (K - 1, 0), (0, 0), (0, 0)])
        out = mx.zeros_like(grouped)
        for tap in range(K):
            shifted = padded[:, K - 1 - tap : K - 1 - tap + L]
            kernel = self.base_kernel[which, tap].reshape(groups, self.group_size) \
                + corrections[:, :, which, tap, :, None]
            out = out + kernel.astype(x.dtype) * shifted
        return out.reshape(B, L, D)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = v1.Attention(args)
        self.mlp = v1.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attention_conv = GroupedDynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.window = args.sliding_window if args.layer_types_or_full[layer] == "sliding_attention" else None
        self.causal = args.layer_is_causal(layer)

    def __call__(
        self, x: mx.array, rope: nn.Module, position: int, cache: DraftContextCache, layer: int
    ) -> mx.array:
        context = cache.stored - cache.attend_start(layer)
        mask = block_mask(context, x.shape[1], self.window, self.causal)
        h = self.input_layernorm(x)
        kernels = self.attention_conv.corrections(h)
        attended = self.self_attn(self.attention_conv(h, kernels, 0), rope, position, cache, layer, mask=mask)
        x = x + self.attention_conv(attended, kernels, 1)
        h = self.post_attention_layernorm(x)
        kernels = self.mlp_conv.corrections(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, kernels, 0)), kernels, 1)


class DFlash2DraftModel(v1.DFlashDraftModel):
    """Context fusion, RoPE and the engine-facing API are v1's; layers, logits and selection are DFlash2's."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(
            args.hidden_size, args.vocab_size, args.selector_rank, args.selector_top_k
        )

    def embed(self, target: TargetModel, tokens: mx.array) -> mx.array:
        h = target.embed(tokens)
        scale = self.args.input_embedding_scale
        return h * scale if scale != 1.0 else h

    def logits(self, hidden: mx.array, target: TargetModel) -> mx.array:
        """The target's lm_head (without the target's own logit finishing), scaled, then soft-capped."""
        logits = target.head(hidden) * self.args.output_multiplier
        cap = self.args.softcap
        return mx.tanh(logits / cap) * cap if cap else logits

    def select(self, hidden: mx.array, anchor: mx.array, target: TargetModel,
               temperature: float = 0.0) -> Selection:
        """Draft tokens for block positions 1.. from their hidden states (B, n, D); `anchor` (B,) precedes them."""
        return self.candidate_selector(hidden, self.logits(hidden, target), anchor, temperature)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Exports through nn.Embedding name the codebooks `<name>.weight`; ours are plain tables.
        out = {}
        for key, value in super().sanitize(weights).items():
            if key.startswith("candidate_selector.") and key.endswith("_codebook.weight"):
                key = key[: -len(".weight")]
            out[key] = value
        return out
