"""What `auto` knows of draft trees: what each budget adds to the linear block, and its price.

A spine tree of budget N drafts the same block as the linear block of the drafter's full size and
holds its draft, so it commits the linear block's tokens (the acceptance model's estimate) plus
what its other branches add. The drafter says what they add: each node is accepted with its
path's probability under the drafter (`DraftBelief`, read with the last tree cycle's one host
read), so the extra nodes of budget N are expected to add the sum of their probabilities. A
drafter's probabilities are not calibrated, so that sum is scaled by `calibration`: what the
other branches actually added (tokens accepted beyond the spine) over what the drafter expected
of them, summed over recent tree cycles.

A budget's price: its calibrated cost (`dflash-mlx calibrate`, where it measured trees), else
the verify of its N + 1 inputs extrapolated along the linear blocks' own costs (the last two
candidate sizes' slope) plus building the tree and its mask, guessed as a drafting cycle's premium
over a plain step (a CPU spends about that); times a measured correction per budget, which a
machine that builds trees faster (a GPU) soon brings down. Before the drafter has said anything, and again after
`STALE` drafting cycles without a tree, the largest budget priced within `TRIAL` of the linear
block is tried once, as soon as what it may lose (its time less the linear choice's for the linear
block's tokens: it holds the linear draft) is within `TRIAL_SHARE` of the drafting time gone by:
a short one-shot generation does not pay much for it, and a chat's or a server's policy keeps what
it learnt across replies. While a tree is chosen, the linear sizes are not probed (a probe would
give up the tree's tokens for news of sizes not in use); near a reply's end a tree drafts fewer
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decoding.tree import DraftBelief
from .estimators import CostModel


@dataclass
class TreeArms:
    """The spine-tree budgets `auto` may verify, with the drafter's last belief and the measured corrections."""

    budgets: tuple[int, ...]
    nodes: dict[int, int]  # budget -> tree nodes
    depth: int  # draft positions (the spine's length)
    belief: DraftBelief | None = None  # the last tree cycle's
    added: float = 0.0  # tokens the other branches added beyond the spine, decayed sum
    hoped: float = 0.0  # what the drafter expected them to add, decayed sum
    ratio: dict[int, float] = field(default_factory=dict)  # budget -> measured seconds over extrapolated
    since_tree: int = 0  # drafting cycles since the last tree cycle
    base: dict[int, tuple[float, float]] = field(default_factory=dict)  # calibrated: budget -> (s, s per position)
    untried: float = 0.0  # seconds of drafting cycles since the last tree cycle

    TRIAL = 1.5  # a trial's price, at most, over the linear block's
    TRIAL_SHARE = 0.2  # of the drafting time since the last tree, what a trial may lose
    STALE = 64  # drafting cycles after which the drafter's belief is asked again
    MEMORY = 16.0  # tree cycles after which old calibration evidence weighs 1/e
    PRIOR = 4.0  # expected nodes' worth of belief in the drafter before its trees are seen
    SMOOTHING = 0.25

    @property
    def calibration(self) -> float:
        """What the other branches add per unit the drafter expects (1 before any evidence)."""
        return (self.added + self.PRIOR) / (self.hoped + self.PRIOR)

    def seconds(self, budget: int, costs: CostModel, sizes: list[int], position: int) -> float:
        """Expected seconds of a tree cycle of `budget` (0.0: the linear costs are not known yet)."""
        if budget in self.base:
            a, b = self.base[budget]
            return max(a + b * position, 1e-6) * self._ratio_for(budget)
        top, below = sizes[-1], sizes[-2] if len(sizes) > 1 else sizes[-1]
        t_top, t_below = costs.predict(top, position), costs.predict(below, position)
        if not t_top:
            return 0.0
        slope = max((t_top - t_below) / (top - below), 0.0) if top > below else 0.0
        # Building the tree and reading the drafter's belief: guessed as a drafting cycle's premium over a
        # plain step (a CPU spends about that on it); the measured correction below scales it with the rest.
        building = max(t_top - costs.predict(1, position), 0.0)
        return (t_top + slope * max(self.nodes[budget] + 1 - top, 0) + building) * self._ratio_for(budget)

    def _ratio_for(self, budget: int) -> float:
        """A budget's own price correction, else the nearest measured budget's (building any tree costs alike)."""
        if budget in self.ratio or not self.ratio:
            return self.ratio.get(budget, 1.0)
        return self.ratio[min(self.ratio, key=lambda b: abs(b - budget))]

    def best(self, linear_tokens: float, rate: float, costs: CostModel, sizes: list[int], position: int,
             overhead: float, depth: int | None = None) -> tuple[int, float, float] | None:
        """The budget to verify now, if any: (budget, expected tokens, seconds). `rate`: the linear choice's;
        `depth`: the draft positions this cycle may take (fewer near the end of a reply)."""
        self.since_tree += 1
        priced = {b: self.seconds(b, costs, sizes, position) for b in self.budgets}
        if not all(priced.values()):
            return None
        linear = costs.predict(sizes[-1], position)
        self.untried += linear
        if self.belief is None or self.since_tree > self.STALE:  # ask the drafter: the widest affordable tree
            trial = [b for b in self.budgets if priced[b] <= self.TRIAL * linear]
            if not trial or (depth is not None and depth < self.depth):
                return None  # (a full-depth tree: its belief is what the next ones are judged by)
            # What it may lose: its time less what the linear choice takes for the linear block's tokens.
            if priced[max(trial)] + overhead - linear_tokens / rate > self.TRIAL_SHARE * (self.untried - linear):
                return None  # not yet paid for by the drafting time gone by
            return max(trial), linear_tokens, priced[max(trial)]
        choice, best_rate = None, rate
        for budget, seconds in priced.items():
            extra = self.belief.expected(self.nodes[budget], depth or self.depth) - self.belief.spine
            tokens = linear_tokens + self.calibration * extra
            if tokens / (seconds + overhead) > best_rate:
                choice, best_rate = (budget, tokens, seconds), tokens / (seconds + overhead)
        return choice

    def observe(self, budget: int, accepted: int, spine: int, belief: DraftBelief, seconds: float,
                predicted: float, depth: int | None = None) -> None:
        """A tree cycle of `budget` (`depth` draft positions) had `accepted` nodes accepted, `spine` of them on
        the spine, in `seconds`."""
        if depth is None or depth == self.depth:  # (a full-depth tree's: what the next ones are judged by)
            keep = 1.0 - 1.0 / self.MEMORY
            self.added = keep * self.added + (accepted - spine)
            self.hoped = keep * self.hoped + belief.expected(self.nodes[budget], self.depth) - belief.spine
            self.belief = belief
        self.since_tree, self.untried = 0, 0.0
        if predicted > 0:
            ratio = self._ratio_for(budget) * seconds / predicted
            old = self.ratio.get(budget)
            self.ratio[budget] = ratio if old is None else old + self.SMOOTHING * (ratio - old)
