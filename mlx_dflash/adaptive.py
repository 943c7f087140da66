"""Draft only while drafting pays: a per-cycle choice between a draft block and a plain step.

A drafting cycle costs a draft plus a multi-token verify and yields its accepted
tokens; a plain cycle costs one target step and yields one token. Which is
cheaper per token depends on the drafter, the text and the machine (a 16-token
verify costs ~1.1 single steps on a GPU, ~1.8 on a 2-core CPU), so both are
measured as decoding runs and the cheaper one is used; the other is re-measured
after `probe_every` cycles, an interval that doubles (up to `max_probe_every`)
while probes keep confirming the choice, so a drafter that never pays costs
little. Both kinds of cycle are exact target decoding steps,
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
    max_probe_every: int = 128
    smoothing: float = 0.2
    warmup: int = 1
    draft: _Cost = field(default_factory=_Cost)
    plain: _Cost = field(default_factory=_Cost)
    _seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    _since_probe: int = 0
    _interval: int = 0  # cycles between probes now (0: probe_every)

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
        # kind and re-measure the other one when the probe interval has passed.
        if self.draft.cycles == 0:
            return True
        if self.plain.cycles == 0:
            return False
        if self._since_probe >= (self._interval or self.probe_every):
            return not self.drafting_pays
        return self.drafting_pays

    def record(self, block_size: int, num_tokens: int, seconds: float) -> None:
        """One finished cycle: its block size, tokens produced and wall time."""
        drafting = block_size > 1
        measured = bool(self.draft.cycles and self.plain.cycles)
        before = self.drafting_pays
        self._seen[drafting] += 1
        if self._seen[drafting] > self.warmup:
            (self.draft if drafting else self.plain).add(seconds, num_tokens, self.smoothing)
        if not measured:
            return
        if self.drafting_pays != before:  # the choice flipped: watch the other kind closely again
            self._interval, self._since_probe = self.probe_every, 0
        elif drafting != before:  # a probe that confirmed the choice: back off
            self._interval = min(2 * (self._interval or self.probe_every), self.max_probe_every)
            self._since_probe = 0
        else:
            self._since_probe += 1
