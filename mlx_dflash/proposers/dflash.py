"""The DFlash proposer: block diffusion over the target's features, v1's way.

`DFlashProposer` drafts a whole block in one drafter forward: the last committed token
and mask tokens, embedded with the target's table, attend to the context K/V that every
committed position's target features injected into each draft layer
(`mlx_dflash.drafters.injection`, kept in `drafters.draft_cache`); the target's lm_head
reads the block, and the argmax at each position is the draft. DFlash2 drafters share
all of it but the choice of tokens (`dflash2.py`).
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ..drafters.dflash import DFlashDraftModel
from ..drafters.draft_cache import DraftContextCache
from ..drafters.injection import ContextInjector
from ..targets.model import TargetModel

logger = logging.getLogger("mlx_dflash")
# Features kept, at most, until a draft shows they injected finite K/V (float16 drafters only).
MAX_UNCONFIRMED = 8192


class DFlashProposer:
    """Block drafting with a DFlash drafter sharing the target's embedding and lm_head."""

    drafts_trees = True  # `draft_logits` scores every token of the block: trees can be drawn from it

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: TargetModel,
        *,
        max_block_size: int,
        window: int | None = None,
        injector: ContextInjector | None = None,
    ):
        args = drafter.args
        self.drafter = drafter
        self.target = target
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.injector = injector or ContextInjector.for_drafter(drafter)
        self.cache = DraftContextCache(
            args.num_hidden_layers,
            args.num_key_value_heads,
            args.head_dim,
            max_block_size=max_block_size,
            dtype=drafter.norm.weight.dtype,
            window=window,
            layer_windows=args.layer_windows,
        )
        self._masks = mx.array([drafter.mask_token_id] * (max_block_size - 1), dtype=mx.uint32)
        # float16 ends at 65504, and targets' features reach that (massive activations): an overflow in
        # the feature projection poisons the draft cache. Each draft's finiteness is read with its verify
        # (`checked`); the features injected since the last finite draft are kept to inject them again.
        self.guarded = self.cache.dtype == mx.float16
        self.last_draft_finite: mx.array | None = None  # () bool, lazily: the last draft's logits were finite
        self._unconfirmed: list[tuple[mx.array, int]] = []  # (features, position) since the last finite draft
        self._drafted_over = 0  # how many of them the last draft read
        self._reinjected = False  # they were injected again in float32 once already

    def _note_draft(self, x: mx.array) -> None:
        if self.guarded:
            self.last_draft_finite = mx.isfinite(x).all()
            self._drafted_over = len(self._unconfirmed)

    def draft_logits(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        """The drafter's logits (block_size - 1, V) at the positions after `last_token`, lazily."""
        block = mx.concatenate([last_token.astype(mx.uint32), self._masks[: block_size - 1]])
        hidden = self.drafter(self.target.embed(block[None]), self.cache, position)
        logits = self.target.logits(hidden[:, 1:])
        self._note_draft(logits)
        return logits[0]

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        return mx.argmax(self.draft_logits(last_token, position, block_size), axis=-1).astype(mx.uint32)

    def commit(self, features: mx.array, position: int) -> None:
        self.injector(features, position, self.cache)
        if self.guarded:
            kept = self._unconfirmed + [(features, position)]
            while sum(f.shape[1] for f, _ in kept) > MAX_UNCONFIRMED and len(kept) > 1:
                kept, self._drafted_over = kept[1:], max(self._drafted_over - 1, 0)
            self._unconfirmed = kept  # a new list: clones of this proposer share the old one

    def checked(self, finite: bool) -> None:
        """After the verify of a draft: forget the features it confirmed, or, if its logits were not
        finite, project features in float32 from now on and inject the unconfirmed ones again.

        The cycle itself stays exact (the target rejects a bad draft); the fallback is for the next.
        """
        if finite:
            self._unconfirmed, self._drafted_over = self._unconfirmed[self._drafted_over:], 0
            return
        if self._reinjected:
            logger.warning("mlx-dflash: the float16 drafter's logits are not finite even with float32 features; "
                           "its drafts will be rejected (convert it to bfloat16)")
            self.guarded, self._unconfirmed = False, []
            return
        if not self.injector.wide:  # the injector is the drafter's: one warning, every session widened
            logger.warning("mlx-dflash: the float16 drafter's logits were not finite (the target's features "
                           "overflow float16); projecting them in float32 from here on")
            self.injector.wide = True
        self._reinjected = True
        if not self._unconfirmed:
            return
        try:
            self.cache.trim(self.cache.offset - self._unconfirmed[0][1])
        except ValueError:  # a sliding draft window no longer holds them: only later positions are helped
            return
        for features, position in self._unconfirmed:
            self.injector(features, position, self.cache)
        self._drafted_over = 0

    def trim(self, num_positions: int) -> None:
        self.cache.trim(num_positions)
        end = self.cache.offset
        self._unconfirmed = [(f[:, : end - p], p) for f, p in self._unconfirmed if p < end]
        self._drafted_over = min(self._drafted_over, len(self._unconfirmed))

    def state_arrays(self) -> list[mx.array]:
        return self.cache.state_arrays()
