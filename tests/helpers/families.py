"""Every family a tiny random target is built for, and the checks of a session's state against another's.

`FAMILIES` (attention families, each with its weight seed) and `HYBRID_CONFIGS` (recurrent and
sliding-window families) together are every supported model type; `build` makes any of them;
`cached_target` / `cached_drafter` serve the `targets` / `drafters` fixtures.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from helpers.tiny import FAMILY_CONFIGS, VOCAB, _randomize, tiny_drafter, tiny_target
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.targets.model import TargetModel

H = 64
WINDOW = 8  # sliding window of the tiny gpt-oss / Gemma targets: blocks straddle it
_QWEN35_TEXT = dict(
    hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
    rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
HYBRID_CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(_QWEN35_TEXT, model_type="qwen3_5_text")),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(
        _QWEN35_TEXT, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=H, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, shared_expert_intermediate_size=32, mlp_only_layers=[],
        moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2,
        rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=4096, head_dim=16,
        norm_topk_prob=True, tie_word_embeddings=False, attention_bias=False, full_attention_interval=2),
    "gpt_oss": dict(
        model_type="gpt_oss", num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, rms_norm_eps=1e-5, hidden_size=H, intermediate_size=64, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, rope_theta=10000.0,
        layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=H, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2,
        rope_theta=10000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=16,
        sliding_window=WINDOW, sliding_window_pattern=2, max_position_embeddings=4096),
    "gemma4_text": dict(
        model_type="gemma4_text", hidden_size=H, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, head_dim=16, global_head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB, num_key_value_heads=2, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, sliding_window=WINDOW, sliding_window_pattern=2,
        max_position_embeddings=4096, layer_types=["sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=30.0, tie_word_embeddings=True),
}


# The multimodal checkpoints' text towers, nested under `language_model` as mlx-lm loads them.
HYBRID_CONFIGS["gemma3"] = dict(model_type="gemma3", vocab_size=VOCAB, text_config={
    k: v for k, v in HYBRID_CONFIGS["gemma3_text"].items() if k != "vocab_size"})


HYBRID_CONFIGS["gemma4"] = dict(model_type="gemma4", vocab_size=VOCAB, text_config={
    k: v for k, v in HYBRID_CONFIGS["gemma4_text"].items() if k != "vocab_size"})


def build(model_type: str, seed: int = 0):
    if model_type in FAMILY_CONFIGS:
        return tiny_target(model_type, seed=seed)
    config = HYBRID_CONFIGS[model_type]
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize(model, seed, scale=2.0)
    return model


def assert_same_state(session: DecodingSession, fresh: DecodingSession) -> None:
    """Two sessions hold the same committed state: target caches (K/V, recurrent) and draft context."""
    assert session.tokens == fresh.tokens
    for ours, theirs in zip(session.cache, fresh.cache, strict=True):
        assert type(ours) is type(theirs) and getattr(ours, "offset", None) == getattr(theirs, "offset", None)
        a, b = tree_flatten(ours.state), tree_flatten(theirs.state)
        assert [k for k, _ in a] == [k for k, _ in b] and a
        for (_, x), (_, y) in zip(a, b, strict=True):
            if not isinstance(x, mx.array):
                assert x == y
                continue
            assert x.shape == y.shape and mx.allclose(x, y, atol=1e-5, rtol=1e-5).item()
    if session.proposer is not None and hasattr(session.proposer, "cache"):
        session.inject_pending()  # queued features belong to the committed draft context
        fresh.inject_pending()
        draft, other = session.proposer.cache, fresh.proposer.cache
        assert draft.offset == other.offset == len(session.tokens) - 1
        # A draft window keeps at least its last `window` positions, however it got there: compare those.
        n = min(draft.window or draft.offset, draft.offset)
        assert draft.stored >= n and other.stored >= n
        for a, b in zip(draft.state_arrays(), other.state_arrays(), strict=True):
            x, y = a[..., draft.stored - n : draft.stored, :], b[..., other.stored - n : other.stored, :]
            assert mx.allclose(x, y, atol=1e-5, rtol=1e-5).item()


def decode(session: DecodingSession, sampler, n: int, block: int) -> list[int]:
    start = len(session.tokens)
    while len(session.tokens) < start + n:
        verified = session.step(sampler, block)
        session.keep(verified, len(verified.tokens))
    return session.tokens[start : start + n]


# The families the core engine supports, each with its own weight seed (llama and
# mistral share a config, so equal seeds would give two identical models).
FAMILIES = {"qwen3": 0, "qwen3_moe": 1, "llama": 2, "mistral": 3, "qwen2": 4}


@functools.cache
def cached_target(family: str, seed: int | None = None, num_layers: int = 4, vocab: int = VOCAB):
    """One tiny random target per (family, seed, depth, vocab) for the whole session.

    Models are never mutated by the engine, so sharing them between tests is safe.
    """
    return tiny_target(family, seed=FAMILIES[family] if seed is None else seed,
                       num_layers=num_layers, vocab=vocab)


@functools.cache
def cached_drafter(family: str, seed: int = 1, block_size: int = 8, mask_token_id: int = 3,
                   num_layers: int = 2):
    return tiny_drafter(cached_target(family), seed=seed, block_size=block_size,
                        mask_token_id=mask_token_id, num_layers=num_layers)


class CountingTarget(TargetModel):
    """Records how many positions each target forward pass computes (what a cache spared)."""

    def __init__(self, model):
        super().__init__(model)
        self.fed: list[int] = []

    def forward(self, tokens, cache, *args, **kwargs):
        self.fed.append(tokens.shape[1])
        return super().forward(tokens, cache, *args, **kwargs)


@functools.cache
def cached_pair(family: str, seed: int = 3):
    """A target of `family` (attention or hybrid) and a DFlash drafter reading its layers 0 and 3."""
    model = build(family, seed=seed)
    return model, tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
