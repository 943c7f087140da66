"""Progress reporting: library code calls a callback; the CLI draws the bars."""

from __future__ import annotations

from collections.abc import Callable

# (stage, done, total): stage is "download", "read", "quantize" or "write"; total 0 means unknown.
ProgressFn = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    """The default: report nothing."""
