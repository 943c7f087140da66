"""The one place proposers are built, and the block size each can draft.

`make_proposer` turns what a caller passes as `draft_model` into the proposer the
decode loop drafts with: a loaded drafter becomes its DFlash (or DFlash2) proposer, on
ranks other than 0 a follower that drafts nothing, and a proposer built by the caller is
used as it is. `make_lookup` gives a session its prompt-lookup index. `check_block_size`
says how wide a block that proposer may draft.
"""

from __future__ import annotations

from typing import Any

from ..drafters.dflash import DEFAULT_BLOCK_SIZE, DFlashDraftModel
from ..drafters.dflash2 import DFlash2DraftModel
from ..errors import DFlashError
from ..targets.model import TargetModel
from .base import Proposer
from .dflash import DFlashProposer
from .dflash2 import DFlash2Proposer
from .lookup import LOOKUP_BLOCK, PromptLookup
from .rank_follower import follows_rank_zero, rank_follower


def make_lookup(enabled: bool) -> PromptLookup | None:
    """Prompt lookup's index for a new session, or None when lookup is off."""
    return PromptLookup() if enabled else None


def dflash_proposer(drafter: DFlashDraftModel, target: TargetModel, **kwargs: Any) -> DFlashProposer:
    """The proposer for a loaded drafter, v1 or DFlash2 (`kwargs`: DFlashProposer's)."""
    cls = DFlash2Proposer if isinstance(drafter, DFlash2DraftModel) else DFlashProposer
    return cls(drafter, target, **kwargs)


def trained_block_size(draft_model: DFlashDraftModel | Proposer | None) -> int | None:
    """The block size the drafter was trained for (None: a proposer that declares none)."""
    if isinstance(draft_model, DFlashProposer):
        return draft_model.drafter.block_size
    return getattr(draft_model, "block_size", None)


def check_block_size(block_size: int | None, draft_model: DFlashDraftModel | Proposer | None, *,
                     lookup: bool = False) -> int:
    """The block size to decode with: by default the drafter's; larger than its trained block is refused.

    Without a drafter it is 1 (plain decoding), whatever was asked, or with `lookup` (prompt
    lookup alone) the size asked, by default `LOOKUP_BLOCK`.
    """
    if block_size is not None and block_size < 1:
        raise DFlashError(f"block size must be >= 1, got {block_size}")
    if draft_model is None:
        return (block_size or LOOKUP_BLOCK) if lookup else 1
    trained = trained_block_size(draft_model)
    if block_size is None:
        return trained or DEFAULT_BLOCK_SIZE
    if trained is not None and block_size > trained:
        raise DFlashError(f"block size {block_size} exceeds the drafter's trained block size {trained}")
    return block_size


def make_proposer(
    target: TargetModel,
    draft_model: DFlashDraftModel | Proposer | None,
    block_size: int,
    draft_window: int | None = None,
) -> Proposer | None:
    """The proposer the decode loop drafts with: a drafter's, a caller's own, or None.

    Distributed, ranks other than 0 verify rank 0's blocks, so a drafter there is replaced by a
    follower that drafts nothing (`rank_follower`); a caller's own proposer runs on every rank.
    """
    if isinstance(draft_model, (DFlashDraftModel, DFlashProposer)) and follows_rank_zero(target):
        return rank_follower(draft_model, max_block_size=block_size, window=draft_window)
    if draft_model is None or isinstance(draft_model, DFlashProposer):
        return draft_model
    if isinstance(draft_model, DFlashDraftModel):
        return dflash_proposer(draft_model, target, max_block_size=block_size, window=draft_window)
    return draft_model  # a custom Proposer (tests, research)
