"""Requests driven through a server `Engine` without HTTP: each one's Steps and Finished, in order."""

from __future__ import annotations

import threading

import numpy as np

from helpers.tiny import EOS_ID, VOCAB, greedy_reference
from mlx_dflash.server import Engine
from mlx_dflash.server.worker.jobs import Finished, GenerationRequest, Step


class Reply:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.steps: list[Step] = []
        self.finished: Finished | None = None
        self.done = threading.Event()

    def __call__(self, item: Step | Finished) -> None:
        self.log.append((self.name, type(item).__name__))
        if isinstance(item, Finished):
            self.finished = item
            self.done.set()
        else:
            self.steps.append(item)

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in s.tokens]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)


def serve_all(engine: Engine, requests: list[GenerationRequest], cancel: int | None = None,
              stop: bool = True) -> list[Reply]:
    """Submit every request, then start the worker; wait for all (cancelling request `cancel` once it streams);
    `stop`: stop the engine after (which empties its prompt cache)."""
    log: list = []
    replies = [Reply(str(i), log) for i in range(len(requests))]
    jobs = [engine.submit(r, reply) for r, reply in zip(requests, replies, strict=True)]
    engine.start()
    try:
        if cancel is not None:
            while len(replies[cancel].steps) < 3 and not replies[cancel].done.is_set():
                replies[cancel].done.wait(0.005)
            jobs[cancel].cancelled.set()
        for reply in replies:
            assert reply.done.wait(120), f"request {reply.name} did not finish"
    finally:
        if stop:
            engine.stop()
    engine.log = log
    return replies


def expected(model, request: GenerationRequest) -> list[int]:
    """mlx-lm's greedy reply to `request`, up to its end-of-sequence token."""
    reference = greedy_reference(model, request.prompt, request.max_tokens)
    return reference[: reference.index(EOS_ID)] if EOS_ID in reference else reference


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, VOCAB, n)] for n in lengths]


def greedy_requests(**fields) -> list[GenerationRequest]:
    return [GenerationRequest(p, n, **fields) for p, n in zip(prompts(0, (12, 70, 3, 41, 25, 90)),
                                                              (30, 12, 45, 24, 40, 33), strict=True)]
