"""The target model side: a forward pass that also returns selected layers' outputs.

mlx-lm models have no hidden-state hook, so each supported family (see
`families.py`) is run from the model's own parts (embedding, masks, layers,
norm, lm_head), reproducing `model(x)` exactly while keeping the outputs of the
selected decoder layers (Hugging Face `hidden_states[i + 1]`). Nothing in
mlx-lm is patched.

Rollback after a partially accepted block: plain K/V caches are trimmed.
Caches that cannot be trimmed (GatedDeltaNet state in `ArraysCache`, rotating
sliding-window buffers) are checkpointed before the verify pass (references
only: MLX arrays are immutable values) and, on rejection, restored; the kept
inputs are then replayed, so the state equals that of a target that consumed
exactly the committed tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from ..distributed.world import Distributed, world
from ..errors import DFlashError
from .families import FAMILIES, MixerInputs, TargetFamily

_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)
_VOCAB_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
# The mlx-lm releases whose model internals `families.py` was checked against (pyproject.toml pins the same).
MLX_LM_TESTED = ">=0.29,<0.33"
_SELF_CHECK_TOKENS = [[1, 5, 9, 2, 7, 3]]


@dataclass
class Checkpoint:
    """Untrimmable cache states before a verify pass, and what that pass fed their mixers."""

    states: dict[int, Any]
    mixer_inputs: MixerInputs = field(default_factory=dict)


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(model_type: str) -> TargetFamily:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise DFlashError(
        f"target model type '{model_type}' is not supported; supported types: "
        + ", ".join(supported_model_types())
    )


def as_target(model: nn.Module | TargetModel) -> TargetModel:
    """`model` wrapped for the engine (a TargetModel passes through unchanged)."""
    return model if isinstance(model, TargetModel) else TargetModel(model)


def check_forward(target: TargetModel) -> None:
    """Refuse a target whose rebuilt forward differs from the model's own `model(x)`.

    `families.py` re-runs each family from mlx-lm's parts (private ones included); an
    mlx-lm release that changes them must fail here, not silently decode another model.
    Both passes run the same ops on the same inputs, so equality is exact.
    """
    tokens = mx.array(_SELF_CHECK_TOKENS, dtype=mx.uint32)
    hidden, _ = target.forward(tokens, target.make_cache())
    ours, theirs = target.logits(hidden), target.model(tokens, cache=target.make_cache())
    if not mx.array_equal(ours, theirs).item():
        gap = mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item()
        raise DFlashError(
            f"mlx-lm {mlx_lm.__version__}: mlx-dflash's forward of this {target.model_type} model differs "
            f"from the model's own (max logit gap {gap:.3g}); mlx-dflash is tested with mlx-lm{MLX_LM_TESTED}"
        )


def copy_state(value: Any) -> Any:
    """`value` with new handles for its arrays, in lists, tuples and nested cache objects.

    Later in-place writes into the live cache must not reach the copy (checkpoints, and the
    server's prompt cache, keep copies beside caches that go on being written).
    """
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(v) for v in value)
    if hasattr(type(value), "state") and hasattr(value, "__dict__"):
        return copy_cache(value)  # a cache nested in another (mlx-lm's CacheList)
    return value


def copy_cache(cache: Any) -> Any:
    """A copy of one cache object (target layer cache or draft context cache)."""
    clone = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(clone, name, copy_state(value))
    return clone


class TargetModel:
    """An mlx-lm causal LM with a capturing forward pass and exact cache rollback."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_type = getattr(model, "model_type", None) or model.args.model_type
        self.family = family_for(self.model_type)
        self.owner = self.family.text_model(model)
        self.inner = self.owner.model
        self.args = self.owner.args
        # Under mlx.launch the model is a tensor-parallel shard: decisions come from rank 0.
        self.world: Distributed | None = world()

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table (the ids the drafter may embed)."""
        return self.inner.embed_tokens.weight.shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        return self.inner.norm.weight.dtype

    def agree(self, x: mx.array) -> mx.array:
        """Rank 0's `x` on every rank when the target is distributed; `x` itself otherwise."""
        return x if self.world is None else self.world.agree(x)

    def agree_int(self, value: int) -> int:
        """Rank 0's host-side choice (a block size) on every rank; `value` itself when not distributed."""
        return value if self.world is None else int(self.world.agree(mx.array([value])).item())

    def agree_tokens(self, ids: Sequence[int]) -> list[int]:
        """Rank 0's token ids on every rank (a prompt each rank tokenized itself); `ids` when not distributed."""
        return list(ids) if self.world is None else self.world.share_tokens(list(ids))

    def heartbeat(self) -> None:
        """Distributed: this rank is making progress (the watchdog measures silence from here)."""
        if self.world is not None:
            self.world.progress()

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def embed(self, tokens: mx.array) -> mx.array:
        """The raw embedding rows (what the drafter consumes; no family scaling)."""
        return self.inner.embed_tokens(tokens)

    def _lm_head(self) -> nn.Module | None:
        """The separate lm_head, or None where the embedding is used as the head (tied)."""
        tied = getattr(self.owner, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(self.args, "tie_word_embeddings", False)
        return None if tied or "lm_head" not in self.owner else self.owner.lm_head

    @property
    def head_is_sharded(self) -> bool:
        """Tensor parallel with the lm_head split over the vocabulary: any logits are then a collective."""
        return isinstance(self._lm_head(), _VOCAB_SHARDED)

    def head(self, hidden: mx.array) -> mx.array:
        """The lm_head (or the tied embedding) alone, without the family's logit finishing."""
        head = self._lm_head()
        if head is None:
            return self.inner.embed_tokens.as_linear(hidden)
        if isinstance(head, _VOCAB_SHARDED):  # tensor parallel: each rank holds a slice of the vocabulary
            return gather_last_axis(head(hidden), head.group)
        return head(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Final-normed hidden states -> logits (the lm_head, or the tied embedding)."""
        out = self.head(hidden)
        finish = self.family.finish_logits
        return finish(self.owner, out) if finish is not None else out

    def forward(
        self, tokens: mx.array, cache: list[Any], capture: Sequence[int] = (),
        checkpoint: Checkpoint | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Run the decoder on `tokens` (B, L), updating `cache`.

        Returns the final-normed hidden states (B, L, D) and the outputs of the
        `capture` layers concatenated on the feature axis (B, L, len(capture)*D),
        or None when nothing is captured. With a `checkpoint`, families that can
        record their recurrent mixers' inputs do so into it (for a cheap rollback).
        """
        family = self.family
        h = family.embed(self.inner, tokens) if family.embed else self.embed(tokens)
        captured: list[mx.array | None] = [None] * len(capture)

        def keep(i: int, out: mx.array) -> None:
            # A layer may be listed twice (the default rule repeats layers on shallow targets).
            for slot, layer in enumerate(capture):
                if layer == i:
                    captured[slot] = out

        if family.run_layers is not None:
            record = checkpoint.mixer_inputs if checkpoint is not None else None
            h = family.run_layers(self.inner, tokens, h, cache, keep, record)
        else:
            masks = family.build_masks(self.inner, h, cache)
            for i, (layer, c, mask) in enumerate(zip(self.inner.layers, cache, masks, strict=True)):
                h = layer(h, mask, c)
                keep(i, h)
        features = mx.concatenate(captured, axis=-1) if capture else None
        return self.inner.norm(h), features

    def checkpoint(self, cache: list[Any]) -> Checkpoint | None:
        """References to the state of caches that cannot be trimmed (None when all can)."""
        saved = {i: copy_state(c.state) for i, c in enumerate(cache) if not isinstance(c, _TRIMMABLE)}
        return Checkpoint(saved) if saved else None

    def rollback(self, cache: list[Any], num_tokens: int, checkpoint: Checkpoint | None = None,
                 replay: mx.array | None = None) -> None:
        """Drop the last `num_tokens` positions from the cache.

        With a checkpoint taken before the last forward (whose first inputs, kept,
        are `replay`), untrimmable caches are restored and brought forward over the
        kept inputs: by re-running only their recurrent mixers on the recorded
        inputs when the family recorded them, else by replaying the whole model.
        """
        if num_tokens <= 0:
            return
        if checkpoint is None:
            for c in cache:
                if not isinstance(c, _TRIMMABLE):
                    raise DFlashError(f"target cache {type(c).__name__} cannot be rolled back")
                c.trim(num_tokens)
            return
        kept = 0 if replay is None else replay.shape[-1]
        mixers_only = set(checkpoint.states) <= set(checkpoint.mixer_inputs)
        for i, c in enumerate(cache):
            if i not in checkpoint.states:
                c.trim(num_tokens if mixers_only else num_tokens + kept)
                continue
            c.state = copy_state(checkpoint.states[i])
            if mixers_only and kept:
                self.family.replay_mixer(self.inner, i, checkpoint.mixer_inputs[i][:, :kept], c)
        if kept and not mixers_only:
            self.forward(replay.reshape(1, -1), cache)
