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
- Hope: choices are made on each p_k raised by `HOPE` x sqrt(p (1 - p)) / n (n: the drafts
  that reached it, and its prior's weight; `AcceptanceModel.hopeful`). A position tried
  rarely may be better than it looks and only a draft can tell, so after a first draft
  rejected with nothing else known the drafter is tried again at once and deeper positions
  are reached; the bonus fades as 1 / n, so a drafter well known is judged on its rates.
  What is expected of a choice (its prediction, trees, cuts) uses the rates as they are.
- t(L): a calibration (seconds per size, linear in the context, `calibration.py`) or,
  before one exists, a generic shape (a GPU's, or a CPU's where MLX computes on one) in
  units of the first measured cycle; every measured cycle corrects its size's price. The
  machine's load changes every size's price: a size not measured lately keeps its own
  correction scaled by how the load moved since (`CostModel.level`), and one never
  measured takes its neighbours'. A slow cycle raises a price by at most a quarter
  (another process took the machine); a fast one lowers it at once. A draft after plain
  steps pays for injecting the positions they left.
- Probes keep the estimates of other sizes fresh: at most every `min_gap` cycles (after
  `WHOLE_RUN` blocks accepted whole in a row, at once: the next size is worth measuring), and only
  while what probes are expected to lose against the best size stays within
  `probe_share` of the time, a neighbour of the best size is tried: the next larger one
  after a block accepted whole (never a smaller one then: it would measure nothing new),
  else the better-scoring neighbour.
- With no evidence of the drafter yet, the widest block priced within 1.5x the narrowest is tried
  (on a Mac, the widest: one cycle measures every position), verified whole; the drafter's confidence
  in each of its positions (`cut` is told it) counts as `BELIEF` observations of each
  (`AcceptanceModel.believe`), so that a first draft rejected where the drafter was sure of it
  (bad luck) is tried again, and one it doubted is taken at its word. Uncalibrated, a plain step follows
  once `WEAK_AFTER` drafts show a first position accepted less than half the time (what a plain
  step costs is then worth knowing), and comes first after a long prefill, whose time per
  position prices each verified input (`CostModel.per_input`) where a wide verify costs many steps.
- On plain steps the drafter is asked again (`_ask`) when what finding it good again would bring
  (drafting at its long-run rate over the few tokens a bad patch is expected to last, times the
  chance its first position is accepted now) outweighs what the draft is expected to lose; each
  refusal in a row doubles the wait, so a long patch costs few asks.

- Where a wide verify costs much more than a narrow one (a block costs `CUT_STEEP` x a block of 2 or
  more: a CPU, a quantized target, a long context), a linear draft that is not a probe or an ask
  is `confident`: after drafting, the session tells `cut` the drafter's confidence in each position,
  and only the prefix worth its price is verified (`confident_prefix.py`); the first draft, read for
  `BELIEF` on any device, is verified whole.

Each proposal source (the DFlash drafter, prompt lookup: `mlx_dflash.proposers.lookup`) keeps its own
acceptance and costs; plain steps are priced for all alike. Each cycle takes the source and
size with the best E[L] / t(L) among the sources that can propose now. Prompt lookup is
never probed: what its proposal would have done is read off every cycle's committed tokens
(`shadow`), so its estimate costs nothing to keep fresh.

When a plain step is best by a margin, whatever any source might propose, and no probe can
come next, `promise_plain` lets the session launch the next plain step before this one is
read (`mlx_dflash.decoding.session`); the promise binds the next choice. The per-cycle work is a few dozen
float operations on Python numbers: no array work, no host sync.

Several generations at once (the server's concurrent requests) each take a `fork`: their own
cycle state and acceptance (what one text shows says nothing of another's), this machine's
costs shared; what a finished one learnt of the drafter seeds the next (`absorb`).

The contract every policy keeps (`BlockSizePolicy`) and the fixed size (`FixedBlockSize`)
belong to the decode loop (`mlx_dflash.decoding.block_size`); `__all__` names them here
too, with the rest of what a caller builds a policy from.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from ..decoding.block_size import TREE, BlockSizePolicy, FixedBlockSize
from ..decoding.tree import SHAPES, SPINE, DraftBelief, tree_nodes
from ..errors import DFlashError
from ..proposers.base import DFLASH, LOOKUP
from ..proposers.lookup import LOOKUP_BLOCK
from .confident_prefix import ConfidenceMap, best_prefix
from .estimators import AcceptanceModel, CostModel, Source, default_shape, generic_cost, verify_cost
from .trees import TreeArms

__all__ = ["AUTO", "DEFAULT_BLOCK_SIZE", "DEFAULT_TREE_BUDGET", "DEFAULT_TREE_SHAPE", "DFLASH", "LOOKUP_BLOCK",
           "TREE_BUDGETS", "AcceptanceModel", "AutoBlockSize", "BlockSizePolicy", "CostModel", "FixedBlockSize",
           "Source", "candidate_sizes", "generic_cost", "absorb", "fork", "make_policy", "parse_block_size",
           "parse_tree_budget", "parse_tree_shape", "reproducible", "verify_cost"]

AUTO = "auto"
DEFAULT_BLOCK_SIZE = AUTO  # the one default of chat, generate, bench, the API and the server
DEFAULT_TREE_BUDGET = 0  # the default `--tree-budget` of chat, generate, bench, the API and the server
DEFAULT_TREE_SHAPE = SPINE
TREE_BUDGETS = (16, 32, 64)  # the tree budgets `--tree-budget auto` weighs
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


def parse_tree_budget(text: str | int | None) -> int | str:
    """A `--tree-budget` value: "auto" (also for None), 0 (linear blocks) or a positive node count."""
    if text is None or str(text).strip().lower() == AUTO:
        return AUTO
    try:
        budget = int(text)
    except ValueError:
        raise DFlashError(f"tree budget must be 'auto', 0 or a positive integer, got {text!r}") from None
    if budget < 0:
        raise DFlashError(f"tree budget must be 'auto', 0 or a positive integer, got {text!r}")
    return budget


def parse_tree_shape(text: str | None) -> str:
    """A `--tree-shape` value: "spine" (the default) or "paper"."""
    shape = SPINE if text is None else str(text).strip().lower()
    if shape not in SHAPES:
        raise DFlashError(f"tree shape must be one of {', '.join(SHAPES)}, got {text!r}")
    return shape


def make_policy(block_size: int | str, max_block: int, calibration: Any = None, *,
                drafter: bool = True, lookup: bool = False, tree_budget: int | str = 0,
                tree_shape: str = SPINE) -> BlockSizePolicy:
    """The policy for a `block_size` setting ("auto" or an int) with a drafter of `max_block`
    (`drafter`: one proposes; `lookup`: prompt lookup proposes too, or alone).

    `tree_budget`: verify the drafter's blocks as draft trees of that many nodes (0: never;
    "auto": `auto` chooses among `TREE_BUDGETS`, and a fixed block size takes linear blocks)."""
    if block_size != AUTO:
        fixed = 0 if tree_budget == AUTO or not drafter else int(tree_budget)
        return FixedBlockSize(min(int(block_size), max_block), tree_budget=fixed, tree_shape=tree_shape)
    if max_block <= 1 or not (drafter or lookup):
        return FixedBlockSize(1)
    learnt = getattr(calibration, "acceptance", None)
    if learnt is not None and learnt.depth != max_block - 1:
        learnt = None
    budgets = () if not drafter or not tree_budget else TREE_BUDGETS if tree_budget == AUTO else (int(tree_budget),)
    return AutoBlockSize(max_block, base_costs=getattr(calibration, "costs", None), acceptance=learnt,
                         drafter=drafter, lookup=lookup, tree_budgets=budgets, tree_shape=tree_shape,
                         tree_costs=getattr(calibration, "tree_costs", None), cost_shape=default_shape())


def reproducible(policy: BlockSizePolicy, max_block: int, seed: int | None, temp: float) -> BlockSizePolicy:
    """`policy`, or the fixed block of `max_block` for a seeded sample: a seed repeats a sample
    only if every run verifies blocks of the same sizes, which a timing-driven choice does not.
    Prompt lookup alone then takes plain steps (a fixed wide verify of every match costs more
    than it saves wherever the text is not copied)."""
    if seed is None or temp <= 0 or isinstance(policy, FixedBlockSize):
        return policy
    return FixedBlockSize(max_block if DFLASH in getattr(policy, "sources", {DFLASH: None}) else 1)


def fork(policy: BlockSizePolicy) -> BlockSizePolicy:
    """`policy` for one of several generations running at once (`AutoBlockSize.fork`); a policy
    without state is shared as it is."""
    return policy.fork() if isinstance(policy, AutoBlockSize) else policy


def absorb(policy: BlockSizePolicy, forked: BlockSizePolicy) -> None:
    """Let `policy` keep what its fork `forked` learnt of acceptance, for the generations after."""
    if isinstance(policy, AutoBlockSize) and isinstance(forked, AutoBlockSize) and forked is not policy:
        policy.absorb(forked)


@dataclass
class AutoBlockSize:
    """`--block-size auto`: the expected-tokens-per-second maximiser (see the module docstring)."""

    max_block: int
    base_costs: dict[int, tuple[float, float]] | None = None  # from a calibration
    acceptance: AcceptanceModel | None = None  # shared with a calibration (`acceptance_memory`)
    drafter: bool = True  # a DFlash drafter proposes
    lookup: bool = False  # prompt lookup proposes (beside the drafter, or alone)
    probe_share: float = 0.01  # of the time, what probes may lose against the best size
    min_gap: int = 8  # cycles between probes, at least
    carry_over: float = 6.0  # observations per position a new generation inherits
    prediction: tuple[float, float] | None = None
    sizes: list[int] = field(default_factory=list)
    sources: dict[str, Source] = field(default_factory=dict)
    source: str = DFLASH  # the source of the last choice
    tree_budgets: tuple[int, ...] = ()  # the draft-tree budgets it may verify (none: linear blocks only)
    tree_shape: str = SPINE
    tree_costs: dict[int, tuple[float, float]] | None = None  # from a calibration that measured trees
    cost_shape: Any = generic_cost  # a drafting cycle's cost by size, in plain steps, before sizes are measured
    tree: int = 0  # the last choice's draft-tree budget (0: a linear block)
    trees: TreeArms | None = None  # what is known of each tree budget (set up from `tree_budgets`)
    cut_drafts: bool = True  # a linear draft may be cut to its confident prefix where verifying costs grow
    confidence: ConfidenceMap = field(default_factory=ConfidenceMap)  # the drafter's confidence, calibrated
    confident: bool = False  # the last choice may be cut (`cut`)
    _cut_seen: tuple[list[float], list[float]] | None = None  # the last cut's kept positions: confidence, history
    _tree_expected: tuple[float, float, float] = (0.0, 0.0, 0.0)  # a tree choice's (linear tokens, tokens, s)
    overhead: float = 0.0  # seconds between cycles (streaming), smoothed
    probing: bool = False  # the last choice was a probe
    asking: bool = False  # the last choice asked the drafter again, from plain steps
    _refused: int = 0  # drafts after plain steps (asks, probes) in a row whose first position was rejected
    _unasked: int = 0  # tokens committed by plain steps since the drafter's last cycle
    _since_probe: int = 0
    _credit: float = 0.0  # seconds probes may still lose
    _best_rate: float = 0.0  # during a probe: the best size's expected tokens per second
    _cut_rate: float = 0.0  # the drafter's choice's expected tokens per second (no hope), which a cut must beat
    _whole: bool = False  # the drafter's best size's last block was accepted whole
    _whole_run: int = 0  # ... so many times in a row
    _plain: bool = False  # the last cycle was a plain step
    _promised: bool = False
    HYSTERESIS = 0.1  # after a plain step, drafting must be expected this much faster to be taken
    LONG_PREFILL = 1024  # positions of a prefill long enough to price a verified input by
    FIRST_WIDTH = 1.5  # the first block, nothing known of the drafter: the widest within this of the narrowest's price
    WHOLE_RUN = 3  # blocks accepted whole in a row after which the next size is probed without waiting `min_gap`
    WEAK_AFTER = 2  # drafts before a drafter whose first position fails half the time is called weak
    BELIEF = 1.0  # observations the drafter's confidence in its first draft is worth (`AcceptanceModel.believe`)
    HOPE = 1.0  # the hope in each position's acceptance that choices are made on (`AcceptanceModel.hopeful`)
    CUT_STEEP = 1.25  # a block is cut where it costs this much more than a block of 2, at least
    _position: int = 0
    _first_draft: bool = False
    _last_end: float | None = None

    def __post_init__(self) -> None:
        self.sizes = self.sizes or candidate_sizes(self.max_block)
        base = dict(self.base_costs or {})
        if not self.sources:
            if self.drafter:
                self.sources[DFLASH] = Source(self.acceptance or AcceptanceModel(self.max_block - 1),
                                              CostModel(base, shape=self.cost_shape))
            if self.lookup:
                plain = {1: base[1]} if 1 in base else {}
                self.sources[LOOKUP] = Source(AcceptanceModel(self.max_block - 1), CostModel(plain, shape=verify_cost))
        self.source = next(iter(self.sources))
        self.acceptance = self.sources[DFLASH].acceptance if DFLASH in self.sources else None
        depth = self.max_block - 1
        # `auto` weighs spine trees only: their belief and their spine's acceptance are what it learns from.
        self.trees = TreeArms(self.tree_budgets, {b: tree_nodes(b, depth, SPINE) for b in self.tree_budgets}, depth,
                              base=dict(self.tree_costs or {})) \
            if self.tree_budgets and self.tree_shape == SPINE and DFLASH in self.sources and depth > 1 else None

    @property
    def costs(self) -> CostModel:
        return self.sources[self.source].costs

    def fork(self) -> AutoBlockSize:
        """A policy for one generation beside others: its own cycle state (a promised plain step,
        probes, overhead) and its own acceptance, starting from this one's; the cost models are
        this one's, shared (a cycle costs the same whichever request runs it)."""
        sources = {name: Source(copy.deepcopy(s.acceptance), s.costs) for name, s in self.sources.items()}
        forked = AutoBlockSize(self.max_block, drafter=self.drafter, lookup=self.lookup, probe_share=self.probe_share,
                               min_gap=self.min_gap, carry_over=self.carry_over, sources=sources,
                               tree_budgets=self.tree_budgets, tree_shape=self.tree_shape)
        forked.trees, forked.confidence = copy.deepcopy(self.trees), copy.deepcopy(self.confidence)
        return forked

    def absorb(self, forked: AutoBlockSize) -> None:
        """Take the acceptance `forked` ended with, in place (a calibration's acceptance memory
        shares these objects and saves them), and what it learnt of trees."""
        for name, source in self.sources.items():
            if name in forked.sources:
                vars(source.acceptance).update(copy.deepcopy(vars(forked.sources[name].acceptance)))
        if self.trees is not None and forked.trees is not None:  # and what its trees cost and added
            self.trees = copy.deepcopy(forked.trees)
        self.confidence = copy.deepcopy(forked.confidence)

    def begin(self, prefill: tuple[int, float] | None = None) -> None:
        """A new generation: its text may suit the drafter better or worse than the last one's. A long
        `prefill` (positions, seconds) tells what each verified input costs beyond the first, for the
        sizes not calibrated or measured yet (on a machine short of compute a wide verify costs many steps)."""
        self._last_end, self._promised, self._refused, self._unasked = None, False, 0, 0
        for source in self.sources.values():
            source.acceptance.forget(self.carry_over)
            if prefill is not None and prefill[0] >= self.LONG_PREFILL and prefill[1] > 0:
                source.costs.per_input = prefill[1] / prefill[0]

    def scores(self, position: int, source: str | None = None) -> dict[int, float]:
        """Expected committed tokens per second of every candidate size of `source` (default: the last one's),
        the drafter's acceptance hoped for (`HOPE`: only its drafts can tell what a position tried rarely is
        worth; prompt lookup's record is read off every cycle for free)."""
        source = source or self.source
        model = self.sources[source]
        expected = model.acceptance.expected_tokens(self.HOPE if source == DFLASH else 0.0)
        # Uncalibrated and nothing measured yet: the generic shape (in plain steps).
        seconds = {L: model.costs.predict(L, position) or model.costs.shape(L) for L in self.sizes}
        return {L: expected[L] / (seconds[L] + self.overhead + 1e-9) for L in self.sizes}

    def choose(self, limit: int, position: int, offers: dict[str, int] | None = None) -> int:
        self._position = position
        if self._last_end is not None:
            self.overhead += 0.25 * (time.perf_counter() - self._last_end - self.overhead)
        offers = {DFLASH: self.max_block - 1} if offers is None else offers
        trees = self.trees if TREE in offers else None
        offers = {name: n for name, n in offers.items() if name in self.sources and n > 0}
        self.probing, self.asking, self.confident, self._cut_seen = False, False, False, None
        self.source, self.tree = DFLASH if DFLASH in offers else next(iter(self.sources)), 0
        size, rate = 1, None  # the choice and its expected tokens per second
        if limit > 1 and not self._promised and DFLASH in offers:
            size, rate = self._choose_drafted(position)
            as_is = self.acceptance.expected_tokens()  # without hope: what trees and cuts must beat
            self._cut_rate = as_is[size] / (self.costs.predict(size, position) + self.overhead + 1e-9)
            if trees is not None and size > 1 and not self.asking:  # a tree worth more than a probe's news
                block = min(limit, self.max_block)  # near the end of a reply a tree drafts fewer positions
                tree = trees.best(as_is[block], self._cut_rate, self.costs, self.sizes, position, self.overhead,
                                  block - 1)
                if tree is not None:
                    self.tree, size, rate = tree[0], block, tree[1] / (tree[2] + self.overhead)
                    self.probing = False
                    self._tree_expected = (as_is[block], tree[1], tree[2])
        for name in sorted(offers.keys() - {DFLASH}) if limit > 1 and not self._promised else []:
            scores = self.scores(position, name)  # judged by its shadowed record: never probed
            best = max((L for L in self.sizes if L <= offers[name] + 1), key=scores.__getitem__)
            if best > 1 and scores[best] > (scores[1] if rate is None else rate):
                self.source, size, self.probing, rate, self.tree = name, best, False, scores[best], 0
        self._promised = False
        size = min(size, limit)
        self._first_draft = False
        if self.cut_drafts and self.source == DFLASH and not (self.tree or self.probing or self.asking) and size > 2:
            # The first draft is verified whole (it measures the drafter's positions); `cut` reads its confidence.
            self._first_draft = self.acceptance.evidence == 0
            steep = self.costs.predict(size, position) >= self.CUT_STEEP * self.costs.predict(2, position) > 0
            self.confident = self._first_draft or steep
        self._since_probe = 0 if self.probing else self._since_probe + 1
        seconds = self.costs.predict(size, position)
        expected = self.sources[self.source].acceptance.expected_tokens()[size]
        if self.tree:
            _, expected, seconds = self._tree_expected
        self.prediction = (expected, seconds + self.overhead) if seconds else None
        return size

    def cut(self, confidences: list[float]) -> int:
        """The prefix of the chosen draft worth verifying, by the drafter's confidence in each position
        (`confident_prefix`): what it expects less what its time is worth at the linear choice's rate.
        The first draft is kept whole, its confidences taken as evidence of the drafter (`BELIEF`)."""
        if self._first_draft:
            self.acceptance.believe(confidences, self.BELIEF)
            return len(confidences) + 1
        costs, history = self.sources[DFLASH].costs, self.acceptance.rates()
        keep = best_prefix(confidences, history, self.confidence, self.sizes,
                           lambda L: costs.predict(L, self._position) + self.overhead, self._cut_rate)
        self._cut_seen = (confidences[: keep - 1], history[: keep - 1])
        return keep

    def _choose_drafted(self, position: int) -> tuple[int, float]:
        """The drafter's best size (or a probe of a neighbour, or 1) and the best size's expected rate."""
        scores = self.scores(position, DFLASH)
        costs = self.sources[DFLASH].costs
        if self.acceptance.evidence == 0:  # nothing known of the drafter: a wide block measures many positions
            if costs.per_input and not costs.base and costs.unit is None:
                return 1, scores[1]  # after a long prefill, a plain step's price first: a wide verify may cost many
            seconds = {L: costs.predict(L, position) or costs.shape(L) for L in self.sizes[1:]}
            size = max(L for L in self.sizes[1:] if seconds[L] <= self.FIRST_WIDTH * seconds[self.sizes[1]])
            return size, scores[size]
        if not costs.base and 1 not in costs.ratio and self.acceptance.rates()[0] < 0.5 \
                and self.acceptance.tried[0] >= self.WEAK_AFTER:
            return 1, scores[1]  # uncalibrated, and the drafter looks weak: learn what a plain step costs
        size = max(self.sizes, key=scores.__getitem__)
        if self._plain and scores[size] < (1.0 + self.HYSTERESIS) * scores[1]:
            size = 1  # back from plain steps only by a margin: an estimate aged near a tie would flip-flop
        rate = scores[size]
        if size == 1 and self._ask(scores, position):
            self.asking = True
            return max(self.sizes[1:], key=scores.__getitem__), rate
        probe = self._probe(size, scores, position, 0.0)
        if probe is not None:
            size, self.probing, self._best_rate = probe[0], True, rate
        return size, rate

    def _probe(self, best: int, scores: dict[int, float], position: int, earned: float) -> tuple[int, float] | None:
        """The neighbour of `best` to probe now and what it is expected to lose; None: no probe
        (too soon, not affordable with `earned` more credit, or nothing worth measuring)."""
        # (blocks accepted whole `WHOLE_RUN` times in a row: the next size is worth measuring now)
        if self._since_probe < (1 if self._whole_run >= self.WHOLE_RUN else self.min_gap):
            return None
        i = self.sizes.index(best)
        # After a block accepted whole, a smaller one would measure nothing new.
        neighbours = self.sizes[i + 1 : i + 2] + ([] if self._whole else self.sizes[max(i - 1, 0) : i])
        if not neighbours:
            return None
        probe = max(neighbours, key=scores.__getitem__)
        # Its time less what the best size would take for the tokens it is expected to commit.
        seconds = self.sources[DFLASH].costs.predict(probe, position) or 0.0
        loss = max(seconds * (1.0 - scores[probe] / scores[best]), 0.0)
        return (probe, loss) if self._credit + earned >= loss else None

    def _ask(self, scores: dict[int, float], position: int) -> bool:
        """Ask the drafter again, from plain steps, now? A plain step yields no evidence of it, so asking is
        worth what the answer may bring: with the chance that its first position is accepted now, drafting
        at its long-run rate instead of plain steps over the text a patch is expected to last
        (`TEXT_MEMORY` tokens); against what the draft is expected to lose at today's estimate."""
        if self._unasked < 2**self._refused:  # each refusal in a row doubles the wait: this patch is a long one
            return False
        gain = self._long_run_gain()
        if gain <= 1.0:
            return False
        size = max(self.sizes[1:], key=scores.__getitem__)
        loss = (self.sources[DFLASH].costs.predict(size, position) or 0.0) * (1.0 - scores[size] / scores[1])
        hoped = self.acceptance.rates()[0] * self.acceptance.TEXT_MEMORY / scores[1] * (1.0 - 1.0 / gain)
        return hoped >= loss

    def promise_plain(self) -> bool:
        if self.probing or self._promised:
            return False
        # (today's estimates: the step's ageing may tip the choice after next, never the next one)
        scores = {name: self.scores(self._position, name) for name in self.sources}
        near = 0.95 * (1.0 + self.HYSTERESIS)  # what the next choice, after a plain step, takes to leave them
        if any(by_size[L] >= near * by_size[1] for by_size in scores.values() for L in self.sizes if L > 1):
            return False  # a near tie: this cycle's measurement may change the choice
        self._promised = True
        if DFLASH in self.sources:  # unless the drafter's next cycle may be a probe or ask it again
            self._since_probe, self._unasked = self._since_probe + 1, self._unasked + 1  # as the next cycle sees them
            earned = self.probe_share * self.sources[DFLASH].costs.predict(1, self._position)
            self._promised = self._probe(1, scores[DFLASH], self._position, earned) is None \
                and not self._ask(scores[DFLASH], self._position)
            self._since_probe, self._unasked = self._since_probe - 1, self._unasked - 1
        return self._promised

    def _record_tree(self, size: int, accepted: int, seconds: float, spine: int | None,
                     belief: DraftBelief | None) -> None:
        """A tree cycle: what its branches added and its price; its spine is a linear block's evidence."""
        if spine is not None and belief is not None:
            self.trees.observe(self.tree, accepted, spine, belief, seconds, self._tree_expected[2], size - 1)
            self.acceptance.observe(size - 1, spine)
        self._credit = min(self._credit + self.probe_share * (seconds + self.overhead), 2.0 * seconds)
        self._last_end = time.perf_counter()

    def _long_run_gain(self) -> float:
        """The drafter's best rate at its long-run acceptance, over plain steps' rate."""
        q, costs = min(self.acceptance.long_run, 0.999), self.sources[DFLASH].costs
        seconds = {L: costs.predict(L, self._position) or costs.shape(L) for L in self.sizes}
        best = max((1.0 - q**L) / (1.0 - q) / (seconds[L] + self.overhead) for L in self.sizes if L > 1)
        return best * (seconds[1] + self.overhead)

    def shadow(self, source: str, drafted: int, accepted: int) -> None:
        if source in self.sources:
            self.sources[source].acceptance.observe(drafted, accepted)

    def record(self, size: int, accepted: int, seconds: float, spine: int | None = None,
               belief: DraftBelief | None = None) -> None:
        self._plain = size == 1
        if size == 1:
            self._unasked += 1
        elif self.source == DFLASH:
            self._refused = 0 if accepted else self._refused + (self._unasked > 0)  # asked from plain steps
            self._unasked = 0
        if self.tree:
            self._record_tree(size, accepted, seconds, spine, belief)
            return
        if size > 1:
            self.sources[self.source].acceptance.observe(size - 1, accepted)
        if self._cut_seen is not None:
            self.confidence.observe(*self._cut_seen, accepted)
            self._cut_seen = None
        gone_by = size == 1 or self.source != DFLASH  # text went by without the drafter's word
        if DFLASH in self.sources and gone_by and self._long_run_gain() >= 1.0 + self.HYSTERESIS:
            self.sources[DFLASH].acceptance.age((accepted + 1) / (1 + self._refused))  # slower as refusals mount
        if not self.probing and self.source == DFLASH:
            self._whole = size > 1 and accepted == size - 1
            self._whole_run = self._whole_run + 1 if self._whole else 0
        for source in self.sources.values() if size == 1 else [self.sources[self.source]]:
            source.costs.observe(size, self._position, seconds)
        for source in self.sources.values():  # a source not measured yet is priced in the same plain steps
            if source.costs.unit is None and not source.costs.base:
                source.costs.unit = self.sources[self.source].costs.unit
        if self.probing:  # what it lost in fact: its time less what the best size takes for its tokens
            self._credit -= seconds + self.overhead - (accepted + 1) / self._best_rate
        # Probes may lose `probe_share` of the time, saved up to two cycles' worth.
        self._credit = min(self._credit + self.probe_share * (seconds + self.overhead), 2.0 * seconds)
        self._last_end = time.perf_counter()
