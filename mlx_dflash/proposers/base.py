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


@dataclass
class Proposal:
    """What a sampling proposer drew its draft from: q over each position's candidates."""

    candidates: mx.array  # (..., n, k) token ids, distinct per position
    q: mx.array  # (..., n, k) probabilities, each row summing to 1
