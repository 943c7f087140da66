"""`--block-size auto`: each cycle's block size, chosen to commit the most tokens per second.

A cycle with block L (L = 1: a plain target step) commits E[L] tokens on average
and costs t(L) seconds, plus a per-cycle overhead outside the cycle (streaming,
detokenizing) that every L pays alike. The policy picks the L maximising
E[L] / (t(L) + overhead) among a few candidate sizes:

- E[L] = 1 + sum_{j<L} prod_{k<=j} p_k, from online estimates of p_k, the chance
  that draft position k is accepted given that the draft reached it. Counts decay
  (recent text weighs most); each position's prior is the estimate of the one
  before it, worth two observations, so an unseen deep position is expected to do as
  well as the last seen (worth one, a single rejection just past the chosen block
  would pass ~0.5 to every deeper position, and that block, never drafting there,
  would stay chosen for the rest of the reply), but capped halfway between the pooled
  estimate of all positions before it and certainty: else a few lucky full accepts
  make a chain of positions seen once each look certain, and on a machine where a
  wide block costs many plain steps (a CPU, a 4-bit target) that near-certainty buys
  a 16-token verify that fails early.
  Text changes faster than decay forgets (a list ends, prose begins): a run of
  first-position outcomes the estimates call very unlikely shrinks the first position's
  evidence to a couple of observations and drops the deeper ones' (they restart from
  the chain), and each new generation inherits only a few observations.
- t(L) starts from a calibration (seconds per L, linear in the context length,
  measured on this machine: `calibration.py`) or, without one, from a generic
  shape; measured cycles correct it per L by a smoothed ratio (sizes not measured
  lately take the others'), so t(L) follows the machine's load. Other work only ever
  adds time: a price rises only as far as two slow cycles in a row of that size show (and
  at most 1.25x per cycle), and a faster cycle counts double, so a hiccup does not send
  the choice to sizes it left cheaper-looking.

Greedily exploiting estimates would never learn that an unused size became better,
so choosing is optimistic about what was seen rarely (the first draft position's
acceptance, a size's cost), and every `interval` cycles the runner-up is tried; the
interval doubles while such probes confirm the choice, and is reset when a probe makes
the runner-up look close and at each new generation (new text is when a change is
likeliest). What a probe loses against a cycle of the best size (its time times the
shortfall of its expected rate: with a useless drafter its extra seconds over a plain
step, between two drafting sizes that score alike next to nothing) is paid from a credit
that grows by `probe_budget` of every cycle's time and saves up to two probes: probes
never lose more than that share of the time (1%: where a probe costs twice a plain step,
as at 4k context or on a 4-bit target on a CPU, one in ~100 cycles), and the saved ones
are spent early in a generation. A probe that made the runner-up look close may overdraw the
credit by two more, so that a likely change is confirmed at once.
Deep positions get no optimism of their own: reached rarely by a mediocre drafter, each
would look good and together they would pull toward the widest block.
While plain steps are best and no probe is due, the policy promises the next cycle is a
plain step too (`promise_plain`), so that the loop launches it before reading this one, as
mlx-lm pipelines decoding; the promise binds the next choice. Choosing plain steps is priced
as such a run (the cost model's in-order price times `pipelined`, the saving measured on the
steps launched ahead): priced in order, plain steps lose near-ties they would win, and a
plain step that is not promised is never launched ahead, so the saving would never show.
Whatever L is chosen, each cycle is an exact target decoding step: the policy changes
speed only, never the output. Its per-cycle work is a few dozen float operations on
Python numbers (no array work, no host sync).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import DFlashError

AUTO = "auto"
DEFAULT_BLOCK_SIZE = AUTO  # the one default of chat, generate, bench, the API and the server
BASE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


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
        next `choose` to 1 (the loop launches that step early, pipelining plain steps)."""
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
    if block_size == AUTO:
        if max_block <= 1:
            return FixedBlockSize(1)
        learnt = getattr(calibration, "acceptance", None)
        if learnt is None or learnt.depth != max_block - 1:
            learnt = None
        return AutoBlockSize(max_block, base_costs=calibration.costs if calibration is not None else None,
                             acceptance=learnt)
    return FixedBlockSize(min(int(block_size), max_block))


@dataclass
class AcceptanceModel:
    """Per draft position k: decayed counts of 'reached' and 'accepted', with a chained prior."""

    depth: int  # draft positions (max block - 1)
    prior_mean: float = 0.5  # first position's prior: optimistic enough to try drafting
    prior_strength: float = 1.0
    chain_cap: float = 0.5  # a deep position's prior: at most this far from the pooled estimate to 1
    chain_strength: float = 2.0  # observations a deep position's prior weighs (the first's: prior_strength)
    memory: float = 16.0  # observations of a position after which old ones weigh 1/e
    surprise: float = 0.002  # a run of first-position outcomes this unlikely under the estimates...
    forget_to: float = 2.0  # ...shrinks every position's evidence to this many observations
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    # The current run of equal first-position outcomes: outcome, its odds under the estimate
    # from before the run (which the run itself would otherwise drag along), that estimate.
    _run: tuple[bool, float, float] = (True, 1.0, 0.5)  # (no run yet)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0.0] * self.depth
        self.accepted = self.accepted or [0.0] * self.depth

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify of `drafted` draft tokens accepted the first `accepted` of them."""
        if drafted < 1 or self.depth < 1:
            return
        # The text changed (a list ended, prose began): what was learnt before misleads. Decay
        # alone would take dozens of cycles, during which the old estimates keep choosing badly.
        hit = accepted > 0
        same, odds, p = self._run
        if hit != same:
            odds, p = 1.0, self.rates()[0]
        if hit != (p >= 0.5):  # only a run of the outcome the estimate calls unlikely surprises
            odds *= p if hit else 1.0 - p
        self._run = (hit, odds, p)
        if odds < self.surprise:
            # Deeper positions were measured on the old text too, and a draft failing at the
            # first position says nothing new of them: they restart from the chained prior.
            self.forget(self.forget_to)
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
        self._run = (True, 1.0, 0.5)

    def rates(self, optimism: float = 0.0) -> list[float]:
        """Estimated acceptance per position; `optimism` adds c / (observations + 1) to the
        first position's, for choosing: a drafter not seen yet gets tried, one seen a few
        times is judged on that. Deeper positions get no bonus of their own: they follow
        the chain, since a bonus on every rarely reached position compounds into long blocks."""
        out, prior = [], self.prior_mean
        pooled_a, pooled_r = self.prior_strength * self.prior_mean, self.prior_strength
        for k, (r, a) in enumerate(zip(self.reached, self.accepted, strict=True)):
            if k:  # seen once each and accepted, a chain of positions would climb towards 1
                pooled = pooled_a / pooled_r
                prior = min(prior, pooled + self.chain_cap * (1.0 - pooled))
            strength = self.chain_strength if k else self.prior_strength
            prior = (a + strength * prior) / (r + strength)
            pooled_a, pooled_r = pooled_a + a, pooled_r + r
            out.append(min(prior + optimism / (r + 1.0), 1.0) if optimism and k == 0 else prior)
        return out

    def expected_tokens(self, optimism: float = 0.0) -> list[float]:
        """E[committed tokens | block L] for L = 0..depth + 1 (index L; E[0] unused)."""
        out, total, reach = [0.0, 1.0], 1.0, 1.0
        for p in self.rates(optimism):
            reach *= p
            total += reach
            out.append(total)
        return out


def generic_cost(size: int) -> float:
    """Cost shape (in plain-step units) used before a size is calibrated or measured."""
    return 1.0 if size == 1 else 1.3 + 0.08 * (size - 1)


@dataclass
class CostModel:
    """Seconds per cycle of each block size: base(L, position) x a measured correction.

    The base carries how costs grow with the context (calibrated per size); the smoothed
    ratio measured / base per size follows the machine's load. A size not measured lately
    takes the ratio interpolated between its nearest measured neighbours (a calibration
    whose shape is off, e.g. made with another proposer, is corrected across sizes).
    """

    base: dict[int, tuple[float, float]] = field(default_factory=dict)  # L -> (s, s per position)
    smoothing: float = 0.25
    max_step: float = 1.25  # the most one cycle's measured ratio counts above the current one
    stale_after: int = 32  # observations after which a size's own ratio gives way to the others'
    unit: float | None = None  # uncalibrated: seconds per `generic_cost` unit, from the first cycle
    ratio: dict[int, float] = field(default_factory=dict)  # L -> measured / base, smoothed
    updated: dict[int, int] = field(default_factory=dict)  # L -> observation count at its last update
    counts: dict[int, int] = field(default_factory=dict)  # L -> cycles of L measured
    last: dict[int, float] = field(default_factory=dict)  # L -> its last measured ratio
    observations: int = 0
    _shared: float = 1.0  # recency-weighted mean ratio over the sizes

    def base_seconds(self, size: int, position: int) -> float | None:
        if size in self.base:
            a, b = self.base[size]
            return max(a + b * position, 1e-6)
        return self.unit * generic_cost(size) if self.unit else None

    def predict(self, size: int, position: int) -> float:
        """Expected seconds of a cycle of `size` (0.0: no opinion yet)."""
        base = self.base_seconds(size, position)
        if base is None:
            return 0.0
        return base * self._ratio_for(size)

    def _ratio_for(self, size: int) -> float:
        # Its own ratio when measured lately; else interpolated between the nearest sizes
        # measured lately on either side (the nearest one beyond the ends); else the shared one.
        fresh = {L: r for L, r in self.ratio.items() if self.observations - self.updated[L] <= self.stale_after}
        if size in fresh:
            return fresh[size]
        below = max((L for L in fresh if L < size), default=None)
        above = min((L for L in fresh if L > size), default=None)
        if below is not None and above is not None:
            t = (size - below) / (above - below)
            return fresh[below] + t * (fresh[above] - fresh[below])
        if below is not None or above is not None:
            return fresh[below if below is not None else above]
        return self._shared

    def observe(self, size: int, position: int, seconds: float) -> None:
        if self.base_seconds(size, position) is None:
            self.unit = seconds / generic_cost(size)  # uncalibrated: the generic shape, in seconds
        measured = raw = seconds / self.base_seconds(size, position)
        # The current price: the size's own ratio, or what the others say if its own is stale
        # (the machine's load may have changed since).
        old = self._ratio_for(size) if size in self.ratio else None
        if old is None:  # a calibrated size's first measurement is trusted, up to a hiccup
            self.ratio[size] = min(measured, self.max_step * self._shared) if size in self.base else measured
        else:  # other work only ever adds time: a hiccup (another process, a page fault) leaves the
            # price alone, a lasting slowdown comes through from its second cycle, a speed-up at once
            measured = min(measured, self.max_step * old, max(self.last[size], old))
            self.ratio[size] = old + (self.smoothing if measured > old else 2 * self.smoothing) * (measured - old)
        self.last[size] = raw
        self.observations += 1
        self.updated[size] = self.observations
        self.counts[size] = self.counts.get(size, 0) + 1
        weights = {L: 0.5 ** ((self.observations - t) / self.stale_after) for L, t in self.updated.items()}
        self._shared = sum(w * self.ratio[L] for L, w in weights.items()) / sum(weights.values())


@dataclass
class AutoBlockSize:
    """`--block-size auto`: the expected-tokens-per-second maximiser (see the module docstring)."""

    max_block: int
    base_costs: dict[int, tuple[float, float]] | None = None  # from a calibration
    probe_every: int = 8
    max_probe_every: int = 64
    probe_budget: float = 0.01  # share of the time that probing the runner-up may cost
    carry_over: float = 8.0  # observations per draft position a new generation inherits
    optimism: float = 0.3  # when choosing: acceptance bonus for a drafter seen rarely, and
    # discount on the cost of a size measured rarely (a calibration made under load misprices sizes)
    sizes: list[int] = field(default_factory=list)
    acceptance: AcceptanceModel | None = None
    costs: CostModel | None = None
    overhead: float = 0.0  # seconds between cycles (streaming), smoothed
    pipelined: float = 0.9  # a plain step launched ahead / one launched in order (seconds): learnt, from a hopeful
    # guess (plain steps not chosen are never launched ahead, so a timid one would never be corrected)
    predicted_tokens: float = 0.0  # sums over the chosen cycles, for predicted vs measured tok/s
    predicted_seconds: float = 0.0
    measured_tokens: float = 0.0  # the same cycles as measured
    measured_seconds: float = 0.0
    _seen: set[int] = field(default_factory=set)
    _interval: int = 0
    _since_probe: int = 0
    _probing: bool = False
    _best: int = 0
    _credit: float = float("inf")  # seconds that probes may still cost (full at the start)
    _probe_extra: float = 0.0  # what a probe of the last ranking is expected to lose (seconds)
    _best_rate: float = 0.0  # the best size's expected tokens per second at the last ranking
    _close: bool = False  # the last probe made the runner-up look close
    _promised: bool = False  # the next cycle was promised to be a plain step
    _ahead: bool = False  # this cycle is a promised plain step, launched before the last one was read
    _last_end: float | None = None
    prediction: tuple[float, float] | None = None  # the last choice's expected (tokens, seconds)
    _position: int = 0

    def __post_init__(self) -> None:
        self.sizes = self.sizes or candidate_sizes(max(self.max_block, 1))
        self.acceptance = self.acceptance or AcceptanceModel(max(self.max_block - 1, 0))
        self.costs = self.costs or CostModel(dict(self.base_costs or {}))
        self._interval = self.probe_every

    def begin(self) -> None:
        """A new generation starts: the time since the last cycle is not overhead, and new text
        may suit the drafter better or worse: past acceptance weighs less, probes come soon."""
        self._last_end = None
        self._interval = self.probe_every
        self.acceptance.forget(self.carry_over)

    def scores(self, position: int, optimism: float = 0.0) -> dict[int, float]:
        """Expected committed tokens per second for every candidate size; with `optimism`,
        a size whose cost was measured rarely looks up to optimism / 2 cheaper, so that a
        calibration that misprices it (made while the machine was busy) gets corrected."""
        expected = self.acceptance.expected_tokens(optimism)
        return {L: expected[L] / self._seconds(L, position, optimism) for L in self.sizes}

    def _seconds(self, size: int, position: int, optimism: float, measured: int = 0) -> float:
        """A cycle's expected seconds, overhead included, as chosen with `optimism` (after
        `measured` more cycles of the size)."""
        discount = 0.5 * optimism / (self.costs.counts.get(size, 0) + measured + 1.0) ** 2
        return self._cycle_seconds(size, position) * (1.0 - discount) + self.overhead + 1e-9

    def _cycle_seconds(self, size: int, position: int, ahead: bool = True) -> float:
        # Choosing plain steps means a run of them, all but the first launched ahead (module docstring).
        seconds = self.costs.predict(size, position)
        return seconds * self.pipelined if size == 1 and ahead else seconds

    def choose(self, limit: int, position: int) -> int:
        self._position = position
        if self._last_end is not None:
            gap = time.perf_counter() - self._last_end
            self.overhead += 0.25 * (gap - self.overhead)
        if limit <= 1 or self.max_block <= 1:
            size, self._probing = 1, False
        elif self._promised:  # the step was launched already: a plain step of the best size
            size, self._probing = 1, False
            self._since_probe += 1
        else:
            size = self._pick(position)
        self._ahead, self._promised = self._promised, False
        size = min(size, limit)
        seconds = self._cycle_seconds(size, position, self._ahead)
        # No prediction before the cost model has an opinion of this size.
        self.prediction = (self.acceptance.expected_tokens()[size], seconds + self.overhead) if seconds else None
        return size

    def promise_plain(self) -> bool:
        # Plain steps are best, and stay so once this cycle is measured as predicted (it takes
        # some of their optimism). A surprise only delays the switch by a cycle, where a step
        # not launched ahead loses its overlap (~5% of a step on a CPU).
        if self._best != 1 or self._probing:
            return False
        scores = self.scores(self._position, self.optimism)
        plain = 1.0 / self._seconds(1, self._position, self.optimism, measured=1)
        if any(score >= plain for L, score in scores.items() if L != 1):
            return False
        # Until a probe is due: one due but waiting for credit may become affordable with what
        # this cycle earns (a share of its price; if it runs longer, the probe waits one cycle).
        if self._since_probe >= self._interval:
            earned = self.probe_budget * self._cycle_seconds(1, self._position, self._ahead)
            if self._credit + earned >= (-2.0 if self._close else 1.0) * self._probe_extra:
                return False
        self._promised = True
        return True

    def _pick(self, position: int) -> int:
        # Measure each of the extremes once before trusting a model that has seen nothing.
        for size in (self.sizes[-1], 1):
            if size not in self.costs.ratio and not self.costs.base:
                return size
        ranked = sorted(self.sizes, key=self.scores(position, self.optimism).__getitem__, reverse=True)
        best, runner_up = ranked[0], ranked[1]
        if best != self._best:  # the choice changed: watch the alternatives closely again
            self._best, self._interval, self._since_probe = best, self.probe_every, 0
        # A probe costs the time it loses against spending its cycle on the best size, as the
        # estimates see it (no optimism): with a useless drafter its extra seconds over a plain
        # step; between two drafting sizes that score alike, next to nothing.
        honest = self.scores(position)
        self._best_rate = honest[best]
        self._probe_extra = self.costs.predict(runner_up, position) * max(1.0 - honest[runner_up] / honest[best], 0.0)
        affordable = self._credit >= (-2.0 if self._close else 1.0) * self._probe_extra
        self._probing = self._since_probe >= self._interval and affordable
        if self._probing:
            self._since_probe = 0
            self._interval = min(2 * self._interval, self.max_probe_every)
            return runner_up
        self._since_probe += 1
        return best

    def record(self, size: int, accepted: int, seconds: float) -> None:
        if size > 1:
            self.acceptance.observe(size - 1, accepted)
        first = size not in self._seen
        # A size's first cycle may include setup (allocation), which only adds time: so it is
        # skipped, unless it beat the size's price (then the price was too high: keep that news).
        # A probe skipped so is not repeated at once: its acceptance counted, and a wide block
        # costs as much again (11 plain steps for a 12-token verify of a 4-bit target on a CPU).
        price = self._cycle_seconds(size, self._position, self._ahead)
        measured = size in self.sizes and (not first or seconds < price)
        if measured:
            in_order = seconds
            if self._ahead:  # the cost model keeps in-order prices; the saving of launching ahead apart
                ratio = seconds / max(self.costs.predict(1, self._position), 1e-9)
                self.pipelined += 0.1 * (min(max(ratio, 0.5), 1.0) - self.pipelined)
                in_order = seconds / self.pipelined
            self.costs.observe(size, self._position, in_order)
        self._seen.add(size)
        if self._probing:
            scores = self.scores(self._position)
            # A draft accepted where the best is a plain step: the text may suit the drafter now.
            self._close = scores[self._best] < 1.1 * scores.get(size, 0.0) or (accepted > 0 and self._best == 1)
            if self._close:  # the alternative now looks close: look again soon
                self._interval = self.probe_every
        if self._probing:  # what it lost in fact: its time less what the best size takes for its tokens
            self._credit -= seconds + self.overhead - (accepted + 1) / self._best_rate
        # Probes may take `probe_budget` of the time, saved up for at most two of them.
        self._credit = min(self._credit + self.probe_budget * seconds, 2.0 * self._probe_extra)
        if self.prediction is not None:
            self.predicted_tokens += self.prediction[0]
            self.predicted_seconds += self.prediction[1]
            self.measured_tokens += accepted + 1
            self.measured_seconds += seconds + self.overhead
        self._last_end = time.perf_counter()

    @property
    def predicted_tps(self) -> float:
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds > 0 else 0.0

    @property
    def measured_tps(self) -> float:
        """Committed tokens per second over the cycles that have a prediction."""
        return self.measured_tokens / self.measured_seconds if self.measured_seconds > 0 else 0.0
