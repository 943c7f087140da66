"""The DFlash drafter in PyTorch: the z-lab layout, its training forward, and the block loss.

The same computation as the MLX drafter (`mlx_dflash/drafters/dflash.py`) and its training forward
(`model.py`): parameter names equal the published safetensors keys, queries come
from the block, keys/values from the fused target features (context) and the
block, RoPE in the half-split layout at absolute positions. Block j starts at
anchor a_j and sees the context before a_j and its own block, nothing else.
Norms compute in float32, so bf16 autocast changes only the matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        hidden, eps = c["hidden_size"], c["rms_norm_eps"]
        self.self_attn = Attention(hidden, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], eps,
                                   bool(c.get("attention_bias", False)))
        self.mlp = MLP(hidden, c["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


class TorchDFlashDrafter(nn.Module):
    """A DFlash v1 drafter built from its z-lab config.json; owns no embedding and no lm_head."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        if config.get("rope_scaling"):
            raise DFlashError("the PyTorch trainer supports plain RoPE only (the drafter config has rope_scaling)")
        self.config = dict(config)
        dflash = config["dflash_config"]
        self.block_size = int(dflash.get("block_size", config.get("block_size", 16)))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        hidden = config["hidden_size"]
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config["rms_norm_eps"])
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])
        head_dim = config["head_dim"]
        inv_freq = float(config["rope_theta"]) ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.inv_freq
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE (MLX `traditional=False`, Hugging Face `rotate_half`), computed in float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def block_token_ids(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
                    ) -> torch.Tensor:
    """(B, T) tokens, (B, N) anchors -> (B, N, block_size): the anchor token, then masks."""
    first = torch.gather(tokens, 1, anchors)[..., None]
    masks = torch.full((*anchors.shape, block_size - 1), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([first, masks], dim=-1)


def attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean (B, 1, N*bs, T + N*bs): the context before the anchor, and the own block."""
    B, N = anchors.shape
    device = anchors.device
    sees_context = torch.arange(context_len, device=device)[None, None, :] < anchors[:, :, None]  # (B, N, T)
    sees_context = sees_context.repeat_interleave(block_size, dim=1)
    block_of = torch.arange(N * block_size, device=device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
    return torch.cat([sees_context, own_block], dim=-1)[:, None]


def _attention(attn: Attention, x: torch.Tensor, context: torch.Tensor, block_rope, context_rope,
               mask: torch.Tensor) -> torch.Tensor:
    B, L, _ = x.shape
    T = context.shape[1]
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(B, L, H, hd)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(B, L, KV, hd)).transpose(1, 2)
    v = attn.v_proj(x).view(B, L, KV, hd).transpose(1, 2)
    ctx_k = attn.k_norm(attn.k_proj(context).view(B, T, KV, hd)).transpose(1, 2)
    ctx_v = attn.v_proj(context).view(B, T, KV, hd).transpose(1, 2)
    q, k = _rotate(q, *block_rope), _rotate(k, *block_rope)
    ctx_k = _rotate(ctx_k, *context_rope)
    # Query head h reads key/value head h // (H / KV), as MLX's grouped attention does.
    keys = torch.cat([ctx_k, k], dim=2).repeat_interleave(H // KV, dim=1)
    values = torch.cat([ctx_v, v], dim=2).repeat_interleave(H // KV, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=hd**-0.5)
    return attn.o_proj(out.transpose(1, 2).reshape(B, L, H * hd))


def draft_blocks(drafter: TorchDFlashDrafter, block_embeddings: torch.Tensor, target_features: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """The training forward of every block of a batch in one pass.

    block_embeddings: (B, N, block_size, D), the target's embedding of `block_token_ids`.
    target_features: (B, T, k*D), the selected target layers' outputs (as `fc` reads them).
    anchors: (B, N) block start positions (padding anchors may be 0: they see no context).
    Returns final-normed hidden states (B, N, block_size, D); the target's lm_head follows.
    """
    B, N, bs, D = block_embeddings.shape
    context = drafter.hidden_norm(drafter.fc(target_features))
    T = context.shape[1]
    mask = attention_mask(anchors, T, bs)
    positions = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).reshape(B, 1, N * bs)
    block_rope = drafter.rope_tables(positions)
    context_rope = drafter.rope_tables(torch.arange(T, device=anchors.device))
    h = block_embeddings.reshape(B, N * bs, D)
    for layer in drafter.layers:
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), context, block_rope, context_rope, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(B, N, bs, D)


def init_from_target(drafter: TorchDFlashDrafter, target_layers: nn.ModuleList, target_norm: nn.Module
                     ) -> list[str]:
    """Start the drafter from the target: its final norm and its top layers' weights (as the MLX trainer does).

    Draft layer i starts as target layer n - L + i wherever names and shapes agree; the q/k
    norms, which the target may not have, stay at one. Returns the names copied.
    """
    own = drafter.state_dict()
    copied = {"norm.weight": target_norm.weight}
    top = list(target_layers)[len(target_layers) - len(drafter.layers):]
    for i, layer in enumerate(top):
        for name, value in layer.state_dict().items():
            key = f"layers.{i}.{name}"
            if key in own and own[key].shape == value.shape:
                copied[key] = value
    with torch.no_grad():
        for key, value in copied.items():
            own[key].copy_(value.to(own[key].dtype))
    return sorted(copied)


def block_labels(labels_seq: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity (B, N, block_size - 1) of the positions each block predicts (see loss.block_labels)."""
    B, T = labels_seq.shape
    N = anchors.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)[None, None, :]
    inside = pos < T
    flat = pos.clamp(max=T - 1).reshape(B, -1)
    labels = torch.gather(labels_seq, 1, flat).reshape(B, N, block_size - 1)
    wanted = torch.gather(loss_mask, 1, flat).reshape(B, N, block_size - 1)
    return labels, inside & wanted & anchor_valid[:, :, None]


def decayed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean CE over valid positions, and the per-position argmax hits (see loss.decayed_cross_entropy)."""
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    w = weights * valid.float()
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    hits = (logits.argmax(dim=-1) == labels) & valid
    return loss, hits
