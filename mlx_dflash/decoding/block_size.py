"""What the decode loop asks before each cycle and tells after it: the block-size policy's contract.

The loop (`session.DecodingSession.cycle`) takes each cycle's block size and proposal
source from a `BlockSizePolicy` and reports what the cycle did. `FixedBlockSize` is the
policy of a fixed `--block-size N`; `--block-size auto`, which chooses for the most tokens
per second, is `mlx_dflash.auto.policy.AutoBlockSize`. Whatever a policy chooses, every
cycle is an exact target decoding step: it changes the speed, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..proposers.base import DFLASH, LOOKUP


class BlockSizePolicy(Protocol):
    """What the decode loop asks before each cycle and tells after it."""

    prediction: tuple[float, float] | None  # the last choice's expected (tokens, seconds)

    def begin(self) -> None:
        """A generation starts (after its prefill)."""
        ...

    source: str  # the last choice's proposal source

    def choose(self, limit: int, position: int, offers: dict[str, int] | None = None) -> int:
        """Block size of the next cycle (at most `limit`), the pending token at `position`;
        `offers`: the sources that can propose now, and how many tokens each can (default:
        the drafter). The chosen source is left in `source`."""
        ...

    def promise_plain(self) -> bool:
        """Asked after choosing a plain step: will the next cycle be one too? True binds the
        next `choose` to 1 (the session launches that step early)."""
        ...

    def record(self, size: int, accepted: int, seconds: float) -> None:
        """The cycle just chosen finished: its block size, accepted draft tokens, wall time."""
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

    def begin(self) -> None:
        pass

    def choose(self, limit: int, position: int, offers: dict[str, int] | None = None) -> int:
        """The drafter's block when there is one, else prompt lookup's when it has a match."""
        offers = {DFLASH: self.size - 1} if offers is None else offers
        self.source = DFLASH if DFLASH in offers else LOOKUP
        return max(min(self.size, limit, offers.get(self.source, 0) + 1), 1)

    def promise_plain(self) -> bool:
        return self.size == 1

    def record(self, size: int, accepted: int, seconds: float) -> None:
        pass

    def shadow(self, source: str, drafted: int, accepted: int) -> None:
        pass
