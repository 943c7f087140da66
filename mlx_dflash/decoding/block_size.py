"""What the decode loop asks before each cycle and tells after it: the block-size policy's contract.

The loop (`session.DecodingSession.cycle`) takes each cycle's block size and proposal
source from a `BlockSizePolicy` and reports what the cycle did. `FixedBlockSize` is the
policy of a fixed `--block-size N`; `--block-size auto`, which chooses for the most tokens
per second, is `mlx_dflash.auto.policy.AutoBlockSize`. Whatever a policy chooses, every
cycle is an exact target decoding step: it changes the speed, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..proposers.base import DFLASH, LOOKUP
from .tree import SPINE

TREE = "tree"  # an offer: this cycle's drafted block may be verified as a draft tree (`tree.py`)


class BlockSizePolicy(Protocol):
    """What the decode loop asks before each cycle and tells after it."""

    prediction: tuple[float, float] | None  # the last choice's expected (tokens, seconds)

    def begin(self, prefill: tuple[int, float] | None = None) -> None:
        """A generation starts, after its prefill: (positions fed, seconds), where measured."""
        ...

    source: str  # the last choice's proposal source
    tree_budgets: tuple[int, ...]  # the draft-tree budgets it may choose (none: linear blocks only)
    tree: int  # the last choice's draft-tree budget (0: a linear block); only when `TREE` was offered
    tree_shape: str  # "spine" or "paper" (`tree.SHAPES`)
    confident: bool  # the last choice's linear draft may be cut to the prefix `cut` keeps

    def choose(self, limit: int, position: int, offers: dict[str, int] | None = None) -> int:
        """Block size of the next cycle (at most `limit`), the pending token at `position`;
        `offers`: the sources that can propose now, and how many tokens each can (default:
        the drafter), and `TREE` when the drafter's block may be a tree. The chosen source is
        left in `source`, the tree budget in `tree`."""
        ...

    def cut(self, confidences: list[float]) -> int:
        """Asked after drafting the block chosen `confident`: the drafter's confidence in each drafted
        position (its argmax's probability); returns the block size to verify (2 ... the block)."""
        ...

    def promise_plain(self) -> bool:
        """Asked after choosing a plain step: will the next cycle be one too? True binds the
        next `choose` to 1 (the session launches that step early)."""
        ...

    def record(self, size: int, accepted: int, seconds: float, spine: int | None = None,
               belief: Any = None) -> None:
        """The cycle just chosen finished: its block size, accepted draft tokens, wall time (and for
        a spine tree, what its linear draft alone would have had accepted and what the drafter
        expected of the tree: `tree.DraftBelief`)."""
        ...

    def shadow(self, source: str, drafted: int, accepted: int) -> None:
        """A source not verified this cycle would have had the first `accepted` of its first
        `drafted` tokens accepted (read off the committed tokens)."""
        ...


@dataclass
class FixedBlockSize:
    """Always the same block size (`--block-size N`)."""

    size: int
    prediction: tuple[float, float] | None = None
    source: str = DFLASH
    tree_budget: int = 0  # verify the drafter's block as a tree of this many nodes where offered (0: never)
    tree_shape: str = SPINE
    tree: int = 0
    confident: bool = False

    @property
    def tree_budgets(self) -> tuple[int, ...]:
        return (self.tree_budget,) if self.tree_budget else ()

    def begin(self, prefill: tuple[int, float] | None = None) -> None:
        pass

    def choose(self, limit: int, position: int, offers: dict[str, int] | None = None) -> int:
        """The drafter's block when there is one, else prompt lookup's when it has a match."""
        offers = {DFLASH: self.size - 1} if offers is None else offers
        self.source = DFLASH if DFLASH in offers else LOOKUP
        self.tree = self.tree_budget if TREE in offers else 0
        return max(min(self.size, limit, offers.get(self.source, 0) + 1), 1)

    def cut(self, confidences: list[float]) -> int:
        return len(confidences) + 1

    def promise_plain(self) -> bool:
        return self.size == 1

    def record(self, size: int, accepted: int, seconds: float, spine: int | None = None,
               belief: Any = None) -> None:
        pass

    def shadow(self, source: str, drafted: int, accepted: int) -> None:
        pass
