"""`--block-size auto`: each cycle's block size, chosen to commit the most tokens per second.

The rule: a block of L tokens (L = 1: a plain target step) commits on average

    E[L] = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_(L-1)

tokens, where p_k is the chance that draft position k is accepted once the draft reached
it, and costs t(L) seconds. Each cycle takes the candidate size with the largest
E[L] / t(L). Whatever it takes, the cycle is an exact target decoding step: the policy
changes the speed, never the output.

- p_k: decayed counts of 'reached' and 'accepted' per position (recent text weighs
  most), over a prior: the pooled estimate of the positions before it, so that a deep
  position, reached rarely, is judged by the evidence of the shallower ones. When the
  first position does much worse (or better) than its estimate several cycles in a row,
  the text has changed (a list ended, prose began) and old evidence is dropped.
- t(L): a calibration (seconds per size, linear in the context, `calibration.py`) or,
  before one exists, a generic shape in units of the first measured cycle; every
  measured cycle corrects its size's price (sizes not measured lately take their
  neighbours' correction: the machine's load changes them all). A slow cycle raises a
  price by at most a quarter (another process took the machine); a fast one lowers it
  at once. A draft after plain steps pays for injecting the positions they left.
- Probes keep the estimates of other sizes fresh: at most every `min_gap` cycles, and only
  while what probes are expected to lose against the best size stays within
  `probe_share` of the time, a neighbour of the best size is tried: the next larger one
  after a block accepted whole (never a smaller one then: it would measure nothing new),
  else the better-scoring neighbour.
- With no evidence of the drafter yet, the widest block is tried: one cycle measures
  every position. Uncalibrated, a plain step follows when its first position was rejected.

Each proposal source (the DFlash drafter; others may join) keeps its own acceptance and
costs; plain steps are priced for all alike. When a plain step is best by a margin and
no probe can come next, `promise_plain` lets the session launch the next plain step
before this one is read (`session.py`); the promise binds the next choice.
The per-cycle work is a few dozen float operations on Python numbers: no array work,
no host sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import DFlashError

AUTO = "auto"
DEFAULT_BLOCK_SIZE = AUTO  # the one default of chat, generate, bench, the API and the server
BASE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
DFLASH = "dflash"  # the drafter's source name


def candidate_sizes(max_block: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, then x1.5 steps, up to and including `max_block`."""
    sizes = [s for s in BASE_SIZES if s <= max_block]
    while sizes[-1] * 3 // 2 <= max_block and sizes[-1] >= 16:
        sizes.append(sizes[-1] * 3 // 2)
    if sizes[-1] != max_block:
        sizes.append(max_block)
    return sizes


def parse_block_size(text: str | int | None) -> int | str:
    """A `--block-size` value: "auto" (also for None) or a positive integer."""
    if text is None or str(text).strip().lower() == AUTO:
        return AUTO
    try:
        size = int(text)
    except ValueError:
        raise DFlashError(f"block size must be 'auto' or a positive integer, got {text!r}") from None
    if size < 1:
        raise DFlashError(f"block size must be 'auto' or a positive integer, got {text!r}")
    return size


class BlockSizePolicy(Protocol):
    """What the decode loop asks before each cycle and tells after it."""

    prediction: tuple[float, float] | None  # the last choice's expected (tokens, seconds)

    def begin(self) -> None:
        """A generation starts (after its prefill)."""
        ...

    def choose(self, limit: int, position: int) -> int:
        """Block size of the next cycle (at most `limit`), the pending token at `position`."""
        ...

    def promise_plain(self) -> bool:
        """Asked after choosing a plain step: will the next cycle be one too? True binds the
        next `choose` to 1 (the session launches that step early)."""
        ...

    def record(self, size: int, accepted: int, seconds: float) -> None:
        """The cycle just chosen finished: its block size, accepted draft tokens, wall time."""
        ...


@dataclass
class FixedBlockSize:
    """Always the same block size (`--block-size N`)."""

    size: int
    prediction: tuple[float, float] | None = None

    def begin(self) -> None:
        pass

    def choose(self, limit: int, position: int) -> int:
        return min(self.size, limit)

    def promise_plain(self) -> bool:
        return self.size == 1

    def record(self, size: int, accepted: int, seconds: float) -> None:
        pass


def make_policy(block_size: int | str, max_block: int, calibration: Any = None) -> BlockSizePolicy:
    """The policy for a `block_size` setting ("auto" or an int) with a drafter of `max_block`."""
    if block_size != AUTO:
        return FixedBlockSize(min(int(block_size), max_block))
    if max_block <= 1:
        return FixedBlockSize(1)
    learnt = getattr(calibration, "acceptance", None)
    if learnt is not None and learnt.depth != max_block - 1:
        learnt = None
    return AutoBlockSize(max_block, base_costs=getattr(calibration, "costs", None), acceptance=learnt)


def reproducible(policy: BlockSizePolicy, max_block: int, seed: int | None, temp: float) -> BlockSizePolicy:
    """`policy`, or the fixed block of `max_block` for a seeded sample: a seed repeats a sample
    only if every run verifies blocks of the same sizes, which a timing-driven choice does not."""
    if seed is None or temp <= 0 or isinstance(policy, FixedBlockSize):
        return policy
    return FixedBlockSize(max_block)


@dataclass
class AcceptanceModel:
    """Per draft position k: decayed counts of 'reached' and 'accepted'."""

    depth: int  # draft positions (max block - 1)
    memory: float = 12.0  # observations of a position after which old ones weigh 1/e
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    _odds: float = 1.0  # how likely, under the estimate, the current run of surprising first positions is

    PRIOR = 0.6  # the first position's estimate before any evidence, worth one observation
    CHAIN = 4.0  # observations a deeper position's prior (the positions before it, pooled) is worth
    CHANGED = 0.01  # a run of first-position outcomes this unlikely: the text changed

    def __post_init__(self) -> None:
        self.reached = self.reached or [0.0] * self.depth
        self.accepted = self.accepted or [0.0] * self.depth

    @property
    def evidence(self) -> float:
        """Observations of the first position (0: nothing known of the drafter)."""
        return self.reached[0] if self.depth else 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify of `drafted` draft tokens accepted the first `accepted` of them."""
        if drafted < 1 or self.depth < 1:
            return
        p, hit = self.rates()[0], accepted > 0
        self._odds = self._odds * (p if hit else 1.0 - p) if hit != (p >= 0.5) else 1.0
        if self._odds < self.CHANGED:  # deeper positions were measured on the old text too
            self.forget(self.CHAIN)
            self.reached[1:] = [0.0] * (self.depth - 1)
            self.accepted[1:] = [0.0] * (self.depth - 1)
        keep = 1.0 - 1.0 / self.memory
        for k in range(min(accepted + 1, drafted, self.depth)):
            self.reached[k] = keep * self.reached[k] + 1.0
            self.accepted[k] = keep * self.accepted[k] + (k < accepted)

    def forget(self, weight: float) -> None:
        """Keep every estimate but let it weigh at most `weight` observations."""
        scale = min(1.0, weight / max(max(self.reached, default=0.0), 1e-9))
        self.reached = [r * scale for r in self.reached]
        self.accepted = [a * scale for a in self.accepted]
        self._odds = 1.0

    def rates(self) -> list[float]:
        """Estimated acceptance per position: its own counts over a prior worth `CHAIN`
        observations, the pooled estimate of the positions before it (drafters are about
        as good a few positions on; a deep position, reached rarely, takes their word)."""
        out, pooled_a, pooled_r = [], self.PRIOR, 1.0
        for k, (r, a) in enumerate(zip(self.reached, self.accepted, strict=True)):
            weight = self.CHAIN if k else 1.0
            out.append((a + weight * pooled_a / pooled_r) / (r + weight))
            pooled_a, pooled_r = pooled_a + a, pooled_r + r
        return out

    def expected_tokens(self) -> list[float]:
        """E[committed tokens | block L] for L = 0..depth + 1 (index L; E[0] unused)."""
        out, total, reach = [0.0, 1.0], 1.0, 1.0
        for p in self.rates():
            reach *= p
            total += reach
            out.append(total)
        return out


def generic_cost(size: int) -> float:
    """Cost shape (in plain-step units) used before a size is calibrated or measured: a Mac's,
    where a verify of 16 tokens costs little more than a plain step and a draft pass ~0.3."""
    return 1.0 if size == 1 else 1.3 + 0.02 * (size - 1)


@dataclass
class CostModel:
    """Seconds per cycle of each block size: base(L, position) x a measured correction per size.

    A size not measured lately (or never) takes the correction of the nearest sizes measured
    lately: the machine's load changes every size's cost, not only the ones in use.
    """

    base: dict[int, tuple[float, float]] = field(default_factory=dict)  # L -> (s, s per position)
    unit: float | None = None  # uncalibrated: seconds per `generic_cost` unit, from the first cycle
    ratio: dict[int, float] = field(default_factory=dict)  # L -> measured / base, smoothed
    last: dict[int, float] = field(default_factory=dict)  # L -> its last measured ratio
    updated: dict[int, int] = field(default_factory=dict)  # L -> `observations` at its last measurement
    observations: int = 0

    STALE = 32  # observations of other sizes after which a size's own correction gives way

    def base_seconds(self, size: int, position: int) -> float | None:
        if size in self.base:
            a, b = self.base[size]
            return max(a + b * position, 1e-6)
        return self.unit * generic_cost(size) if self.unit else None

    def predict(self, size: int, position: int) -> float:
        """Expected seconds of a cycle of `size` (0.0: no opinion yet)."""
        base = self.base_seconds(size, position)
        return 0.0 if base is None else base * self._ratio_for(size)

    def _ratio_for(self, size: int) -> float:
        fresh = {L: r for L, r in self.ratio.items() if self.observations - self.updated[L] <= self.STALE}
        if size in fresh or not fresh:
            return fresh.get(size, self.ratio.get(size, 1.0))
        below = max((L for L in fresh if L < size), default=None)
        above = min((L for L in fresh if L > size), default=None)
        if below is None or above is None:
            return fresh[below if above is None else above]
        t = (size - below) / (above - below)
        return fresh[below] + t * (fresh[above] - fresh[below])

    def observe(self, size: int, position: int, seconds: float) -> None:
        if self.base_seconds(size, position) is None:
            self.unit = seconds / generic_cost(size)
        measured = seconds / self.base_seconds(size, position)
        if not self.ratio:
            self.ratio[size] = measured
        else:  # other work only adds time: one slow cycle moves a price little, two in a row more
            old = self._ratio_for(size)
            clipped = min(measured, 1.25 * old, max(self.last.get(size, old), old))
            self.ratio[size] = old + 0.25 * (clipped - old) if clipped > old else clipped
        self.last[size] = measured
        self.observations += 1
        self.updated[size] = self.observations


@dataclass
class Source:
    """What `auto` knows of one proposal source: its acceptance and its cycles' costs."""

    acceptance: AcceptanceModel
    costs: CostModel


@dataclass
class AutoBlockSize:
    """`--block-size auto`: the expected-tokens-per-second maximiser (see the module docstring)."""

    max_block: int
    base_costs: dict[int, tuple[float, float]] | None = None  # from a calibration
    acceptance: AcceptanceModel | None = None  # shared with a calibration (`acceptance_memory`)
    probe_share: float = 0.01  # of the time, what probes may lose against the best size
    min_gap: int = 8  # cycles between probes, at least
    carry_over: float = 6.0  # observations per position a new generation inherits
    prediction: tuple[float, float] | None = None
    sizes: list[int] = field(default_factory=list)
    sources: dict[str, Source] = field(default_factory=dict)
    source: str = DFLASH  # the source of the last choice
    overhead: float = 0.0  # seconds between cycles (streaming), smoothed
    probing: bool = False  # the last choice was a probe
    _since_probe: int = 0
    _credit: float = 0.0  # seconds probes may still lose
    _best_rate: float = 0.0  # during a probe: the best size's expected tokens per second
    _whole: bool = False  # the best size's last block was accepted whole
    _promised: bool = False
    _position: int = 0
    _last_end: float | None = None

    def __post_init__(self) -> None:
        self.sizes = self.sizes or candidate_sizes(self.max_block)
        acceptance = self.acceptance or AcceptanceModel(self.max_block - 1)
        self.sources = self.sources or {DFLASH: Source(acceptance, CostModel(dict(self.base_costs or {})))}
        self.acceptance = self.sources[DFLASH].acceptance

    @property
    def costs(self) -> CostModel:
        return self.sources[self.source].costs

    def begin(self) -> None:
        """A new generation: its text may suit the drafter better or worse than the last one's."""
        self._last_end, self._promised = None, False
        for source in self.sources.values():
            source.acceptance.forget(self.carry_over)

    def scores(self, position: int) -> dict[int, float]:
        """Expected committed tokens per second of every candidate size."""
        expected = self.acceptance.expected_tokens()
        # Uncalibrated and nothing measured yet: the generic shape (in plain steps).
        seconds = {L: self.costs.predict(L, position) or generic_cost(L) for L in self.sizes}
        return {L: expected[L] / (seconds[L] + self.overhead + 1e-9) for L in self.sizes}

    def choose(self, limit: int, position: int) -> int:
        self._position = position
        if self._last_end is not None:
            self.overhead += 0.25 * (time.perf_counter() - self._last_end - self.overhead)
        self.probing = False
        if limit <= 1 or self._promised:
            size = 1
        elif self.acceptance.evidence == 0:
            size = self.sizes[-1]  # nothing known of the drafter: the widest block measures every position
        elif not self.costs.base and 1 not in self.costs.ratio and self.acceptance.rates()[0] < 0.5:
            size = 1  # uncalibrated, and the drafter looks weak: learn what a plain step costs
        else:
            scores = self.scores(position)
            size = max(self.sizes, key=scores.__getitem__)
            probe = self._probe(size, scores, position, 0.0)
            if probe is not None:
                size, self.probing, self._best_rate = probe[0], True, scores[size]
        self._promised = False
        size = min(size, limit)
        self._since_probe = 0 if self.probing else self._since_probe + 1
        seconds = self.costs.predict(size, position)
        self.prediction = (self.acceptance.expected_tokens()[size], seconds + self.overhead) if seconds else None
        return size

    def _probe(self, best: int, scores: dict[int, float], position: int, earned: float) -> tuple[int, float] | None:
        """The neighbour of `best` to probe now and what it is expected to lose; None: no probe
        (too soon, not affordable with `earned` more credit, or nothing worth measuring)."""
        if self._since_probe < self.min_gap:
            return None
        i = self.sizes.index(best)
        # After a block accepted whole, a smaller one would measure nothing new.
        neighbours = self.sizes[i + 1 : i + 2] + ([] if self._whole else self.sizes[max(i - 1, 0) : i])
        if not neighbours:
            return None
        probe = max(neighbours, key=scores.__getitem__)
        # Its time less what the best size would take for the tokens it is expected to commit.
        loss = max((self.costs.predict(probe, position) or 0.0) * (1.0 - scores[probe] / scores[best]), 0.0)
        return (probe, loss) if self._credit + earned >= loss else None

    def promise_plain(self) -> bool:
        if self.probing or self._promised:
            return False
        scores = self.scores(self._position)
        if any(scores[L] >= 0.95 * scores[1] for L in self.sizes if L > 1):
            return False  # a near tie: this cycle's measurement may change the choice
        self._since_probe += 1  # as the next cycle will see it
        earned = self.probe_share * self.costs.predict(1, self._position)
        self._promised = self._probe(1, scores, self._position, earned) is None
        self._since_probe -= 1
        return self._promised

    def record(self, size: int, accepted: int, seconds: float) -> None:
        if size > 1:
            self.acceptance.observe(size - 1, accepted)
        if not self.probing:
            self._whole = size > 1 and accepted == size - 1
        for source in self.sources.values() if size == 1 else [self.sources[self.source]]:
            source.costs.observe(size, self._position, seconds)
        if self.probing:  # what it lost in fact: its time less what the best size takes for its tokens
            self._credit -= seconds + self.overhead - (accepted + 1) / self._best_rate
        # Probes may lose `probe_share` of the time, saved up to two cycles' worth.
        self._credit = min(self._credit + self.probe_share * (seconds + self.overhead), 2.0 * seconds)
        self._last_end = time.perf_counter()
