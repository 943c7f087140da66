"""What a generation's cycles add up to: tau, the acceptance and block-size histograms, speeds.

`GenerationStats` is filled in by the decode loop (`loop.stream_session`), one `add_cycle`
per verify cycle, and carried by every event; `CycleSummary` derives the figures from
its per-cycle lists, for one generation or a whole chat's totals alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


def mean_acceptance(lengths: Sequence[int]) -> float:
    """tau: mean tokens committed per verify cycle."""
    return sum(lengths) / max(len(lengths), 1)


def acceptance_histogram(lengths: Sequence[int]) -> list[int]:
    """histogram[n] = cycles that committed n tokens."""
    counts = [0] * (max(lengths, default=0) + 1)
    for n in lengths:
        counts[n] += 1
    return counts


class CycleSummary:
    """What cycles add up to, for anything holding `acceptance_lengths`, `block_sizes`,
    `predicted_tokens` and `predicted_seconds` (one generation's stats, a chat's totals)."""

    acceptance_lengths: list[int]
    block_sizes: list[int]
    predicted_tokens: float
    predicted_seconds: float

    @property
    def tau(self) -> float:
        """Mean tokens per target forward pass in the decode phase."""
        return mean_acceptance(self.acceptance_lengths)

    @property
    def histogram(self) -> list[int]:
        return acceptance_histogram(self.acceptance_lengths)

    @property
    def block_size_histogram(self) -> dict[int, int]:
        """Cycles per chosen block size."""
        return dict(sorted(Counter(self.block_sizes).items()))

    @property
    def predicted_tps(self) -> float | None:
        """Tokens per second the block-size policy's cost model expected (None: no model)."""
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds > 0 else None


@dataclass
class GenerationStats(CycleSummary):
    prompt_tokens: int = 0
    num_tokens: int = 0  # generated tokens (stop token excluded)
    acceptance_lengths: list[int] = field(default_factory=list)  # a + 1 per cycle
    prefill_time: float = 0.0
    decode_time: float = 0.0
    peak_memory_gb: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # draft/verify seconds (profile)
    plain_cycles: int = 0  # cycles run as plain target steps although a drafter was there
    block_sizes: list[int] = field(default_factory=list)  # each cycle's block size (1: a plain step)
    predicted_tokens: float = 0.0  # `--block-size auto`: its expectations, summed over the cycles
    predicted_seconds: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # proposed tokens accepted, per source
    proposed_by_source: dict[str, int] = field(default_factory=dict)  # tokens proposed, per source
    cycles_by_source: dict[str, int] = field(default_factory=dict)  # verify cycles of each source
    tree_sizes: list[int] = field(default_factory=list)  # each cycle's draft-tree nodes (0: a linear block)

    def add_cycle(self, size: int, produced: int, drafter: bool, prediction: tuple[float, float] | None,
                  source: str | None = None, tree_size: int = 0) -> None:
        self.acceptance_lengths.append(produced)
        self.block_sizes.append(size)
        self.tree_sizes.append(tree_size)
        self.plain_cycles += size == 1 and drafter
        if source is not None:
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + produced - 1
            self.proposed_by_source[source] = self.proposed_by_source.get(source, 0) + size - 1
            self.cycles_by_source[source] = self.cycles_by_source.get(source, 0) + 1
        if prediction is not None:
            self.predicted_tokens += prediction[0]
            self.predicted_seconds += prediction[1]


    @property
    def cycles(self) -> int:
        return len(self.acceptance_lengths)


    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens after the first (which comes from the prefill) per decode second."""
        decoded = max(self.num_tokens - 1, 0)
        return decoded / self.decode_time if self.decode_time else 0.0
