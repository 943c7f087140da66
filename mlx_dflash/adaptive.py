"""Draft only while drafting pays: a per-cycle choice between a draft block and a plain step.

A drafting cycle costs a draft plus a multi-token verify and yields its accepted
tokens; a plain cycle costs one target step and yields one token. Which is
cheaper per token depends on the drafter, the text and the machine (a 16-token
verify costs ~1.1 single steps on a GPU, ~1.8 on a 2-core CPU), so both are
measured as decoding runs and the cheaper one is used; the other is re-measured
every `probe_every` cycles. Both kinds of cycle are exact target decoding steps,
so the choice changes speed only, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Cost:
    """Smoothed seconds and tokens per cycle of one kind; their ratio is seconds per token."""

    seconds: float = 0.0
    tokens: float = 0.0
    cycles: int = 0

    def add(self, seconds: float, tokens: int, smoothing: float) -> None:
        if self.cycles == 0:
            self.seconds, self.tokens = seconds, float(tokens)
        else:
            self.seconds += smoothing * (seconds - self.seconds)
            self.tokens += smoothing * (tokens - self.tokens)
        self.cycles += 1

    @property
    def per_token(self) -> float:
        return self.seconds / max(self.tokens, 1e-9)


@dataclass
class AdaptiveDrafting:
    """Chooses each cycle's block size from measured costs; feed it every cycle with `record`.

    The first `warmup` cycles of each kind are not measured (they include compilation).
    """

    probe_every: int = 16
    smoothing: float = 0.2
    warmup: int = 1
    draft: _Cost = field(default_factory=_Cost)
    plain: _Cost = field(default_factory=_Cost)
    _seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    _since_probe: int = 0

    @property
    def drafting_pays(self) -> bool:
        """Whether drafting is the cheaper kind so far (True until both are measured)."""
        if not (self.draft.cycles and self.plain.cycles):
            return True
        return self.draft.per_token <= self.plain.per_token

    def block_size(self, full: int) -> int:
        """The block size for the next cycle: `full` (drafting) or 1 (a plain step)."""
        if full <= 1:
            return full
        drafting = self._choose()
        return full if drafting else 1

    def _choose(self) -> bool:
        # Measure drafting first, then the plain step; afterwards exploit the cheaper
        # kind and re-measure the other one every probe_every cycles.
        if self.draft.cycles == 0:
            return True
        if self.plain.cycles == 0:
            return False
        if self._since_probe >= self.probe_every:
            return not self.drafting_pays
        return self.drafting_pays

    def record(self, block_size: int, num_tokens: int, seconds: float) -> None:
        """One finished cycle: its block size, tokens produced and wall time."""
        drafting = block_size > 1
        self._seen[drafting] += 1
        preferred = self.drafting_pays
        if self._seen[drafting] > self.warmup:
            (self.draft if drafting else self.plain).add(seconds, num_tokens, self.smoothing)
        # A cycle of the kind that is not preferred is a probe: count afresh after it.
        self._since_probe = 0 if drafting != preferred else self._since_probe + 1
