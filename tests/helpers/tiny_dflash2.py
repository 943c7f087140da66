"""Tiny random DFlash2 drafters built from z-lab-style configs (fp32, fast)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from helpers.tiny import OracleProposer, drafter_config
from mlx_dflash.drafters.dflash2 import DFlash2DraftModel, ModelArgs
from mlx_dflash.proposers.base import Proposal


def dflash2_config(target, *, num_layers: int = 3, block_size: int = 8, layer_types=None,
                   sliding_window: int | None = None, is_causal: bool | None = None, softcap: float | None = 30.0,
                   output_multiplier: float = 1.0, top_k: int = 6, rank: int = 8, kernel_size: int = 2,
                   group_size: int = 16, target_layer_ids=None, mask_token_id: int = 3) -> dict:
    """A DFlash2 config as published: v1 fields plus the conv/selector/logit settings in dflash_config."""
    cfg = drafter_config(target, num_layers=num_layers, block_size=block_size, target_layer_ids=target_layer_ids,
                         mask_token_id=mask_token_id)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(
        block_size=block_size, conv_kernel_size=kernel_size, conv_group_size=group_size, selector_rank=rank,
        selector_top_k=top_k, output_multiplier=output_multiplier,
    )
    if softcap is not None:
        cfg["dflash_config"]["final_logit_softcapping"] = softcap
    if layer_types is not None:
        cfg.update(layer_types=layer_types, sliding_window=sliding_window)
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    # transformers-5 style rope settings, as the DFlash2 configs carry them.
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    return cfg


def random_weights(model, seed: int, scale: float = 1.0) -> dict[str, mx.array]:
    """Norms near one, matrices ~ N(0, 1/fan_in) * scale, tables ~ N(0, 1) * scale / 2."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, p in tree_flatten(model.parameters()):
        if p.ndim == 1:
            value = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif "codebook" in key or "base_kernel" in key:
            value = 0.5 * scale * rng.standard_normal(p.shape)
        else:
            value = scale * rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        out[key] = mx.array(value, dtype=mx.float32)
    return out


def tiny_dflash2(target, seed: int = 1, **kwargs) -> tuple[DFlash2DraftModel, dict]:
    cfg = dflash2_config(target, **kwargs)
    model = DFlash2DraftModel(ModelArgs.from_dict(cfg))
    model.load_weights(list(random_weights(model, seed).items()))
    mx.eval(model.parameters())
    return model, cfg


class OracleSampledProposer(OracleProposer):
    """Drafts by sampling the target's own distribution over its top-k tokens, and says so (q).

    `propose_sampled` makes the engine verify by rejection sampling; the inherited `propose`
    (the greedy oracle) is what sample-and-match verifies.
    """

    top_k = 4

    def propose_sampled(self, last_token, position, block_size, temperature):
        assert position == self.committed == len(self.tokens)
        seq = self.tokens + [int(last_token.item())]
        out, cands, qs = [], [], []
        for _ in range(block_size - 1):
            logits = self.model(mx.array(seq + out, dtype=mx.uint32)[None])[0, -1]
            cand = mx.argpartition(logits, -self.top_k)[-self.top_k:]
            scaled = logits[cand] * (1.0 / temperature)
            out.append(int(cand[mx.random.categorical(scaled)].item()))
            cands.append(cand)
            qs.append(mx.softmax(scaled))
        self.pending = seq[-1:] + out
        self.last_draft = mx.array(out, dtype=mx.uint32)
        return self.last_draft, Proposal(mx.stack(cands), mx.stack(qs))
