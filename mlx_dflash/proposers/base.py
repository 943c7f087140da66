"""The one interface every proposer implements, and the names of the proposal sources.

A proposer proposes the tokens that follow the last committed token; the decode loop
(`mlx_dflash.decoding`) verifies them with the target and reaches a proposer only
through `Proposer`. A proposer that samples its draft from a distribution it can state
also has `propose_sampled`, returning that distribution as a `Proposal`, so that the
step can verify by exact speculative rejection sampling. Tests and benchmarks plug in
oracle and always-wrong proposers through the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

DFLASH = "dflash"  # the DFlash drafter's source name (v1 and DFlash2), in the policy and in stats
LOOKUP = "lookup"  # prompt lookup's source name


class Proposer(Protocol):
    """Proposes the tokens that follow the last committed token."""

    target_layer_ids: list[int]

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        """`last_token` (1,) sits at absolute `position`; return block_size - 1 tokens."""
        ...

    def commit(self, features: mx.array, position: int) -> None:
        """Take the committed positions' target features (1, n, k*D) from `position` on."""
        ...

    def trim(self, num_positions: int) -> None:
        """Forget the last committed positions (used when a chat drops a reply)."""
        ...

    def state_arrays(self) -> list[mx.array]:
        """Arrays to evaluate so that committed context is materialised."""
        ...


class ScoringProposer(Proposer, Protocol):
    """A proposer whose block comes from scores of every vocabulary token at every position, its draft
    their argmax: a draft tree can be grown from the scores, and a draft cut to the prefix it is
    confident in (`drafts_trees` says so; a class that draws its block another way sets it False)."""

    drafts_trees: bool

    def draft_logits(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        """(block_size - 1, V) scores of the positions after `last_token`, lazily; `propose` is their argmax."""
        ...


def scores_blocks(proposer: Proposer | None) -> bool:
    """Whether `proposer` is a `ScoringProposer` (the capability is optional: most proposers are not)."""
    return bool(getattr(proposer, "drafts_trees", False))


@dataclass
class Proposal:
    """What a sampling proposer drew its draft from: q over each position's candidates."""

    candidates: mx.array  # (..., n, k) token ids, distinct per position
    q: mx.array  # (..., n, k) probabilities, each row summing to 1
