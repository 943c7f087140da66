"""A request's prefill progress: the positions computed of those to compute, and the seconds so far.

The request's session tells it after each prefill chunk (`DecodingSession.progress`);
`/health` reads `describe_prefill` on the HTTP thread while the worker decodes, so it
holds plain Python values only, never an MLX array. A long prompt also logs its progress
every `LOG_SECONDS` and once when its prefill ends, so a server's log says why a request
has not started streaming.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("mlx_dflash")
LOG_TOKENS = 4096  # prompts computing at least this many positions log their progress
LOG_SECONDS = 5.0  # between two such lines of one request


class PrefillProgress:
    """One request's prefill: `begin` when it starts, then called (fed, total) after each chunk."""

    def __init__(self, total: int):
        self.fed = 0
        self.total = total  # positions to compute: the prompt's new tokens and the pending one
        self.started: float | None = None
        self._logged = 0.0

    def begin(self) -> None:
        if self.started is None:
            self.started = self._logged = time.monotonic()

    def __call__(self, fed: int, total: int) -> None:
        self.begin()
        self.fed, self.total = fed, total
        now = time.monotonic()
        if total >= LOG_TOKENS and (fed >= total or now - self._logged >= LOG_SECONDS):
            self._logged = now
            logger.info("mlx-dflash serve: prefill %d/%d tokens, %.1f s", fed, total, now - self.started)

    def snapshot(self) -> dict[str, Any]:
        started = self.started
        seconds = time.monotonic() - started if started is not None else 0.0
        return {"fed": self.fed, "total": self.total, "seconds": round(seconds, 1)}


def describe_prefill(scheduler: Any) -> list[dict[str, Any]]:
    """Each prefill under way (for /health, from any thread): fed, total and seconds."""
    if scheduler is None:
        return []
    return [run.progress.snapshot() for run in list(scheduler.runs) if run.prefilling]
