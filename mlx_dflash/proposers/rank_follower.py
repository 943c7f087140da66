"""What ranks other than 0 run in place of the drafter.

Distributed, every rank verifies rank 0's block (`target.agree` in `decoding.step.launch_step`)
and commits rank 0's tokens, so the other ranks' drafts are never used. A follower proposes
placeholder tokens of the right length and dtype, which the agreement replaces, and keeps no
draft context: no drafter pass, no context K/V. What it keeps identical to rank 0's proposer
is everything that shapes the collectives every rank must issue in the same order:

- `target_layer_ids`, so the verify forward captures the same layers (the same graph);
- `propose_sampled` exactly where the drafter has it (DFlash2), so temperature > 0 verifies
  by rejection sampling on every rank and the agreed tensor has one shape;
- the draft cache's position bookkeeping (a cache with no layers: no arrays), so `trim`
  refuses exactly when rank 0's windowed cache does, and a chat that then recomputes its
  prefix does so on every rank.

Where the target's lm_head is split over the vocabulary (mlx-lm shards an untied head that
way for Qwen3.5), computing draft logits is itself a collective: rank 0's logits gather each
rank's slice of the vocabulary, computed from that rank's own drafter pass. There every rank
keeps drafting (`follows_rank_zero` is false).
"""

from __future__ import annotations

import mlx.core as mx

from ..drafters.dflash import DFlashDraftModel
from ..drafters.dflash2 import DFlash2DraftModel
from ..drafters.draft_cache import DraftContextCache
from ..targets.model import TargetModel
from .base import Proposal
from .dflash import DFlashProposer


class RankFollower:
    """A `Proposer` that drafts nothing: its blocks are replaced by rank 0's."""

    def __init__(self, target_layer_ids: list[int], *, max_block_size: int, window: int | None = None):
        self.target_layer_ids = list(target_layer_ids)
        # No layers: only the committed-position count, compactions and trim refusals of rank 0's cache.
        self._positions = DraftContextCache(0, 1, 1, max_block_size=max_block_size, window=window)

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        return mx.zeros((block_size - 1,), dtype=mx.uint32)

    def commit(self, features: mx.array, position: int) -> None:
        # Only the shape is read (positions on axis 2, as the context K/V have them); nothing is computed.
        self._positions.append([features[None]], [])

    def trim(self, num_positions: int) -> None:
        self._positions.trim(num_positions)

    def state_arrays(self) -> list[mx.array]:
        return []


class SampledRankFollower(RankFollower):
    """A follower for drafters that sample their drafts (DFlash2): a valid one-hot proposal on token 0."""

    def propose_sampled(self, last_token: mx.array, position: int, block_size: int,
                        temperature: float) -> tuple[mx.array, Proposal]:
        n = block_size - 1
        draft = mx.zeros((n,), dtype=mx.uint32)
        return draft, Proposal(mx.zeros((n, 1), dtype=mx.uint32), mx.ones((n, 1), dtype=mx.float32))


def follows_rank_zero(target: TargetModel) -> bool:
    """Distributed, on a rank other than 0, with a target whose logits need no collective."""
    return target.world is not None and not target.world.is_main and not target.head_is_sharded


def rank_follower(draft: DFlashDraftModel | DFlashProposer, *, max_block_size: int,
                  window: int | None = None) -> RankFollower:
    """The follower standing in for `draft` (a drafter, or a proposer already built around one, whose
    own block and window limits then apply)."""
    if isinstance(draft, DFlashProposer):
        sampled = hasattr(draft, "propose_sampled")
        max_block_size, window = draft.cache.max_block_size, draft.cache.window
    else:
        sampled = isinstance(draft, DFlash2DraftModel)
    cls = SampledRankFollower if sampled else RankFollower
    return cls(list(draft.target_layer_ids), max_block_size=max_block_size, window=window)
