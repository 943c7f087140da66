"""Drafting with a DFlash2 drafter through the engine's `Proposer` seam.

Context injection, the draft cache (with its sliding windows) and the block
forward are v1's (`dflash.DFlashProposer`); only the choice of tokens differs: the
candidate selector walks the block, greedily for `propose`, or sampling at the
target's temperature for `propose_sampled`, which also reports the proposal
distribution q for rejection sampling (`mlx_dflash.decoding.sampling`).
"""

from __future__ import annotations

import mlx.core as mx

from ..drafters.dflash2 import DFlash2DraftModel
from ..drafters.selector import Selection
from .base import Proposal
from .dflash import DFlashProposer


class DFlash2Proposer(DFlashProposer):
    drafter: DFlash2DraftModel
    drafts_trees = False  # its selector walks the block token by token: no per-position scores to branch on

    def _select(self, last_token: mx.array, position: int, block_size: int, temperature: float) -> Selection:
        block = mx.concatenate([last_token.astype(mx.uint32), self._masks[: block_size - 1]])
        hidden = self.drafter(self.drafter.embed(self.target, block[None]), self.cache, position)
        self._note_draft(hidden)
        return self.drafter.select(hidden[:, 1:], last_token.astype(mx.uint32), self.target, temperature)

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        return self._select(last_token, position, block_size, 0.0).tokens[0].astype(mx.uint32)

    def propose_sampled(self, last_token: mx.array, position: int, block_size: int,
                        temperature: float) -> tuple[mx.array, Proposal]:
        """A draft sampled from the selector's q at `temperature`, and q itself."""
        selection = self._select(last_token, position, block_size, temperature)
        return selection.tokens[0].astype(mx.uint32), Proposal(selection.candidates[0], selection.q[0])
