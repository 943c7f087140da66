"""What `auto` knows of a proposal source: how often each draft position is accepted, and
what a cycle of each block size costs (`policy.py` explains how they are used)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AcceptanceModel:
    """Per draft position k: decayed counts of 'reached' and 'accepted'."""

    depth: int  # draft positions (max block - 1)
    memory: float = 12.0  # observations of a position after which old ones weigh 1/e
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)  # `reached` as drafts alone decay it (not `age`, `forget`)
    _odds: float = 1.0  # how likely, under the estimate, the current run of surprising first positions is
    # Positions checked and accepted, pooled over the positions, in the long run (the drafter's usual
    # quality): the first position's prior, which evidence aged by text without drafts gives way to.
    long_reached: float | None = None
    long_accepted: float | None = None

    PRIOR = 0.6  # the first position's estimate before any evidence, worth one observation
    CHAIN = 4.0  # observations a deeper position's prior (the positions before it, pooled) is worth
    CHANGED = 0.01  # a run of first-position outcomes this unlikely: the text changed
    LONG_PRIOR = 8.0  # positions checked that `PRIOR` is worth in the long-run rate
    LONG_MEMORY = 64.0  # positions checked or tokens gone by after which the long-run counts' old ones weigh 1/e
    UNSEEN = 0.25  # what a token gone by without a draft weighs in the long run, against a position checked
    TEXT_MEMORY = 4.0  # tokens committed without a draft after which the first position's evidence weighs 1/e
    MOST = 0.995  # the highest hopeful rate

    def __post_init__(self) -> None:
        self.reached = self.reached or [0.0] * self.depth
        self.accepted = self.accepted or [0.0] * self.depth
        self.tried = self.tried or list(self.reached)
        if self.long_reached is None or self.long_accepted is None:
            self.long_reached, self.long_accepted = sum(self.reached), sum(self.accepted)

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
            self.tried[k] = keep * self.tried[k] + 1.0
            self.accepted[k] = keep * self.accepted[k] + (k < accepted)
        # Long-run: every position checked counts alike (a token of text each), so that a stretch the drafter
        # gets wrong, checked one position per cycle, does not outweigh the stretches it drafts whole.
        reached = min(accepted + 1, drafted)
        keep = math.exp(-reached / self.LONG_MEMORY)
        self.long_reached = keep * self.long_reached + reached
        self.long_accepted = keep * self.long_accepted + accepted

    def believe(self, confidences: list[float], weight: float) -> None:
        """The drafter's own confidence in each position of a draft (its argmax's probability, a chance
        that position is right), taken as `weight` observations of each: what a draft says of the
        drafter before any verify has."""
        for k, c in enumerate(confidences[: self.depth]):
            self.reached[k] += weight
            self.accepted[k] += weight * min(max(c, 0.0), 1.0)

    def age(self, tokens: float) -> None:
        """`tokens` were committed without a draft of this source: what was seen before them says
        less about the text now, so the estimates drift back towards the drafter's long-run quality.
        (A plain step yields no evidence; without this, a bad patch would keep `auto` on plain steps.)
        The long run counts these tokens at the rate last seen, so that a long stretch the drafter
        cannot draft brings it down, and a short one hardly."""
        if self.reached[0] >= 1.0:  # the text went by at the rate last seen: the long run hears of it, faintly
            heard = self.UNSEEN * tokens
            keep = math.exp(-heard / self.LONG_MEMORY)
            self.long_reached = keep * self.long_reached + heard
            self.long_accepted = keep * self.long_accepted + heard * self.accepted[0] / self.reached[0]
        # The first position only: it is what a patch of text the drafter cannot draft fails (the deeper
        # positions, reached once it is passed, keep what they showed).
        scale = math.exp(-tokens / self.TEXT_MEMORY)
        self.reached[0] *= scale
        self.accepted[0] *= scale

    def forget(self, weight: float) -> None:
        """Keep every estimate but let it weigh at most `weight` observations."""
        scale = min(1.0, weight / max(max(self.reached, default=0.0), 1e-9))
        self.reached = [r * scale for r in self.reached]
        self.accepted = [a * scale for a in self.accepted]
        self._odds = 1.0

    @property
    def long_run(self) -> float:
        """The drafter's long-run acceptance per position checked (over `PRIOR`, worth `LONG_PRIOR` positions)."""
        return (self.LONG_PRIOR * self.PRIOR + self.long_accepted) / (self.LONG_PRIOR + self.long_reached)

    def rates(self) -> list[float]:
        """Estimated acceptance per position: its own counts over a prior worth `CHAIN`
        observations, the pooled estimate of the positions before it (drafters are about
        as good a few positions on; a deep position, reached rarely, takes their word). The
        first position's prior, worth one observation, is its long-run rate."""
        out, pooled_a, pooled_r = [], self.long_run, 1.0
        for k, (r, a) in enumerate(zip(self.reached, self.accepted, strict=True)):
            weight = self.CHAIN if k else 1.0
            out.append((a + weight * pooled_a / pooled_r) / (r + weight))
            pooled_a, pooled_r = pooled_a + a, pooled_r + r
        return out

    def hopeful(self, hope: float) -> list[float]:
        """`rates` raised by `hope` x sqrt(p (1 - p)) / n each (n: the drafts that reached it, and its
        prior's weight): a position tried rarely may be better than it looks, and only a draft can tell,
        so choices made on these try it. The bonus fades as 1 / n, faster than a standard error, so that a
        position well known is judged on its rate alone; text gone by without drafts (`age`) does not
        renew it (asking again after plain steps is the policy's own decision)."""
        out = []
        for k, p in enumerate(self.rates()):
            # A deeper position's prior is the shallower ones' pooled: what the first showed counts for it too.
            seen = self.tried[k] + (self.CHAIN + self.tried[0] if k else 1.0) + 1.0
            out.append(min(p + hope * math.sqrt(p * (1.0 - p)) / seen, self.MOST))
        return out

    def expected_tokens(self, hope: float = 0.0) -> list[float]:
        """E[committed tokens | block L] for L = 0..depth + 1 (index L; E[0] unused); with `hope`, of the
        rates hoped for (`hopeful`)."""
        out, total, reach = [0.0, 1.0], 1.0, 1.0
        for p in self.hopeful(hope) if hope else self.rates():
            reach *= p
            total += reach
            out.append(total)
        return out


def generic_cost(size: int) -> float:
    """Cost shape (in plain-step units) used before a size is calibrated or measured: a Mac's,
    where a verify of 16 tokens costs little more than a plain step and a draft pass ~0.3."""
    return 1.0 if size == 1 else 1.3 + 0.02 * (size - 1)


def cpu_generic_cost(size: int) -> float:
    """The same for a CPU (or MLX's CPU backend), where the draft pass and every verified input cost much of
    a step: a block of 16 about 2.25 plain steps (SmolLM2-135M on a 2-core x86 CPU: 2.35)."""
    return 1.0 if size == 1 else 1.5 + 0.05 * (size - 1)


def default_shape() -> Any:
    """The generic cost shape of the device MLX computes on: a GPU's, else a CPU's."""
    import mlx.core as mx

    return cpu_generic_cost if mx.default_device() == mx.cpu else generic_cost


def verify_cost(size: int) -> float:
    """The same shape without a draft pass (prompt lookup's cycles)."""
    return 1.0 + 0.02 * (size - 1)


@dataclass
class CostModel:
    """Seconds per cycle of each block size: base(L, position) x a measured correction per size.

    The machine's load changes every size's cost, not only the ones in use: a size not measured
    lately keeps its own correction (how far its base is off, which a guessed shape may be by
    several times), scaled by how much the load changed since (`level`: the relative changes of
    the corrections of sizes measured again, chained); a size never measured takes the correction
    of the nearest sizes measured lately.
    """

    base: dict[int, tuple[float, float]] = field(default_factory=dict)  # L -> (s, s per position)
    unit: float | None = None  # uncalibrated: seconds per `generic_cost` unit, from the first cycle
    ratio: dict[int, float] = field(default_factory=dict)  # L -> measured / base, smoothed
    last: dict[int, float] = field(default_factory=dict)  # L -> its last measured ratio
    updated: dict[int, int] = field(default_factory=dict)  # L -> `observations` at its last measurement
    observations: int = 0
    level: float = 1.0  # the machine's load, relative: each size measured again moves it by its correction's change
    level_at: dict[int, float] = field(default_factory=dict)  # L -> `level` at its last measurement
    shape: Any = generic_cost  # L -> plain-step units, for sizes not calibrated
    per_input: float = 0.0  # uncalibrated: seconds per verified input beyond the first (a long prefill's rate)

    STALE = 32  # observations of other sizes after which a size's own correction gives way

    def base_seconds(self, size: int, position: int) -> float | None:
        if size in self.base:
            a, b = self.base[size]
            return max(a + b * position, 1e-6)
        if 1 in self.base:
            return self.base_seconds(1, position) * self.shape(size)
        return self.unit * self.shape(size) + self.per_input * (size - 1) if self.unit else None

    def predict(self, size: int, position: int) -> float:
        """Expected seconds of a cycle of `size` (0.0: no opinion yet)."""
        base = self.base_seconds(size, position)
        return 0.0 if base is None else base * self._ratio_for(size)

    def _ratio_for(self, size: int) -> float:
        fresh = {L: r for L, r in self.ratio.items() if self.observations - self.updated[L] <= self.STALE}
        if size in fresh or not fresh:
            return fresh.get(size, self.ratio.get(size, 1.0))
        if size in self.ratio:  # measured, not lately: its own correction at today's load
            return self.ratio[size] * self.level / self.level_at[size]
        below = max((L for L in fresh if L < size), default=None)
        above = min((L for L in fresh if L > size), default=None)
        if below is None or above is None:
            return fresh[below if above is None else above]
        t = (size - below) / (above - below)
        return fresh[below] + t * (fresh[above] - fresh[below])

    def observe(self, size: int, position: int, seconds: float) -> None:
        if self.base_seconds(size, position) is None:
            self.unit = max(seconds - self.per_input * (size - 1), 0.1 * seconds) / self.shape(size)
        measured = seconds / self.base_seconds(size, position)
        if not self.ratio:
            self.ratio[size] = measured
        elif size not in self.base and size not in self.last:
            # A guessed price (the generic shape, or a neighbour's correction): its first measurement
            # replaces it, up to twice the guess (a first cycle may include one-off setup).
            self.ratio[size] = min(measured, 2.0 * self._ratio_for(size))
            if len(self.ratio) == 2 and not self.base and measured < 1.0:
                # The second size measured ever, cheaper than the first one's cycle set the unit for: that
                # cycle held one-off setup, not the shape (which the next measurements correct either way).
                first = next(L for L in self.ratio if L != size)
                self.ratio[first] = measured
        else:  # other work only adds time: one slow cycle moves a price little, two in a row more
            old = self._ratio_for(size)
            clipped = min(measured, 1.25 * old, max(self.last.get(size, old), old))
            self.ratio[size] = old + 0.25 * (clipped - old) if clipped > old else clipped
            if size in self.level_at:  # measured before: how its correction moved is the load's move
                self.level *= self.ratio[size] / old
        self.level_at[size] = self.level
        self.last[size] = measured
        self.observations += 1
        self.updated[size] = self.observations


@dataclass
class Source:
    """What `auto` knows of one proposal source: its acceptance and its cycles' costs."""

    acceptance: AcceptanceModel
    costs: CostModel
