"""What passes between the HTTP side and the decode worker: a request, its job, and what it emits."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ...decoding.stats import GenerationStats


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    top_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    constraint: Any = None  # structured output: () -> a fresh TokenConstraint (`server.structured`), or None


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Step:
    """Newly generated tokens and the text now safe to stream."""

    tokens: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    stats: GenerationStats
    cached_tokens: int = 0
    stop: str | None = None  # the stop string that ended the text
    error: str | None = None


@dataclass
class Job:
    request: GenerationRequest
    emit: Callable[[Step | Finished], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


def token_logprobs(rows: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row (the target's distribution it was sampled
    from: `GenerationEvent.logprobs`), with the `top` most likely alternatives."""
    if not tokens:
        return []
    rows = rows.reshape(-1, rows.shape[-1])[: len(tokens)].astype(mx.float32)
    chosen = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0].tolist()
    top_ids = top_values = None
    if top:
        top_ids = mx.argsort(-rows, axis=-1)[:, :top]
        top_values = mx.take_along_axis(rows, top_ids, axis=-1).tolist()
        top_ids = top_ids.tolist()
    return [
        TokenLogprob(t, lp, list(zip(top_ids[i], top_values[i], strict=True)) if top_ids else [])
        for i, (t, lp) in enumerate(zip(tokens, chosen, strict=True))
    ]
