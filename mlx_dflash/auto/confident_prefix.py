"""What `auto` knows of the drafter's confidence: verify only the prefix of a draft worth its price.

A linear draft comes with the drafter's confidence in each position (the probability of its
argmax token). Where each verified input costs (a CPU, a quantized target, a long context, an
older Mac), the positions after a doubtful one are rarely worth verifying, and which positions
are doubtful differs from cycle to cycle: the history of a position says how often it is accepted
on average, the confidence says which cycles are the bad ones. So a cycle may read the
confidences of the draft just computed (one host read between draft and verify) and verify only
the prefix worth it (what DSpark's confidence-scheduled verifier does).

A drafter's probabilities are not calibrated, and the history follows the text as it changes,
so the confidence corrects the history rather than replacing it: per confidence bin, the
positions accepted over what the history expected of them when they were drafted (decayed sums)
scales the position's history estimate. Each bin starts from `PRIOR` expected acceptances at the
ratio the drafter itself states, softened: (confidence / its typical confidence) ** `TRUST`, so a
one-shot reply already cuts where the drafter doubts. With a confidence that says nothing, the
ratios learn to stay near 1 and the cut follows the history; with one that says much, the cut
follows it.

The length kept maximises E[L'] - R t(L'): the expected committed tokens less what the cycle's
time is worth at R, the rate the linear choice expects (a renewal argument: a cycle that keeps a
longer block must earn its extra time at the rate the rest of decoding runs at); a cut must gain
`MARGIN` tokens over the whole draft, since the estimates it rests on are noisy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MARGIN = 0.2  # tokens a cut must be expected to gain over the whole draft (estimates are noisy)


@dataclass
class ConfidenceMap:
    """Per confidence bin: decayed sums of draft positions accepted and of what the history expected."""

    bins: int = 10
    expected: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    typical: float | None = None  # the drafter's mean confidence at the positions reached, decayed
    seen: float = 0.0  # positions in that mean, up to `MEMORY`

    PRIOR = 2.0  # expected acceptances at a ratio of 1 that each bin starts with
    MEMORY = 64.0  # positions of a bin after which old ones weigh 1/e
    MOST = 0.995  # the highest chance of acceptance it states
    TRUST = 0.75  # a bin's prior ratio: (confidence / typical confidence) ** TRUST

    def __post_init__(self) -> None:
        self.expected = self.expected or [0.0] * self.bins
        self.accepted = self.accepted or [0.0] * self.bins

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.bins), self.bins - 1)

    def rate(self, confidence: float, history: float) -> float:
        """The chance a reached position of this confidence is accepted (`history`: its history's estimate)."""
        confidence = _finite(confidence)
        b = self._bin(confidence)
        told = (confidence / self.typical) ** self.TRUST if self.typical else 1.0
        return min(history * (self.accepted[b] + self.PRIOR * told) / (self.expected[b] + self.PRIOR), self.MOST)

    def observe(self, confidences: Sequence[float], history: Sequence[float], accepted: int) -> None:
        """A verify of a draft with these confidences, whose positions the history gave these chances,
        accepted its first `accepted` positions."""
        keep = 1.0 - 1.0 / self.MEMORY
        for k, (confidence, p) in enumerate(zip(confidences[: accepted + 1], history, strict=False)):
            confidence = _finite(confidence)
            b = self._bin(confidence)
            self.expected[b] = keep * self.expected[b] + p
            self.accepted[b] = keep * self.accepted[b] + (k < accepted)
            self.seen = min(self.seen + 1.0, self.MEMORY)
            self.typical = confidence if self.typical is None else \
                self.typical + (confidence - self.typical) / self.seen


def _finite(confidence: float) -> float:
    """A confidence in [0, 1]; a non-finite draft's (float16 overflow) says nothing: 0."""
    return min(confidence, 1.0) if confidence > 0.0 else 0.0


def best_prefix(confidences: Sequence[float], history: Sequence[float], confidence: ConfidenceMap,
                sizes: Sequence[int], seconds: Callable[[int], float], rate: float) -> int:
    """The block size (a candidate size, at least 2, at most the draft's + 1) worth verifying: the most
    expected tokens less `rate` x its `seconds`. `history`: each position's estimate from its history."""
    expected, reach, total = [0.0, 1.0], 1.0, 1.0
    for c, p in zip(confidences, history, strict=False):
        reach *= confidence.rate(c, p)
        total += reach
        expected.append(total)
    block = len(confidences) + 1
    options = [L for L in sizes if 2 <= L < block] + [block]
    value = {L: expected[L] - rate * seconds(L) for L in options}
    best = max(options, key=value.__getitem__)
    return best if value[best] >= value[block] + MARGIN else block
