"""The decode worker: one thread takes requests in arrival order and decodes them.

Up to `max_batch` requests advance together (`scheduler.py`: batched cycles where the
target and drafter allow, else one cycle each in turn); each request's reply is what
`stream_session` would give it alone. The HTTP side never touches MLX; it submits a
`Job` and receives the job's `Step`s and its final `Finished` through the job's `emit`
callback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...auto.policy import AUTO, DEFAULT_BLOCK_SIZE, DEFAULT_TREE_BUDGET, DEFAULT_TREE_SHAPE, make_policy
from ...batching.batch import batch_footprint
from ...decoding.prefix_marks import turn_openers
from ...decoding.session import DecodingSession
from ...decoding.stats import GenerationStats
from ...generate import tree_settings
from ...platform.runtime import (
    buffer_cache_limit,
    default_batch_bytes,
    default_prompt_cache_bytes,
    settle,
    wired_limit,
)
from ...proposers.factory import check_block_size, make_lookup, make_proposer
from ...targets.model import TargetModel
from .jobs import Finished, GenerationRequest, Job, Step
from .prefill_progress import describe_prefill
from .prompt_cache import PromptCache
from .prompt_disk import PromptDisk
from .scheduler import Scheduler, describe_batch


@dataclass
class EngineConfig:
    block_size: int | str = DEFAULT_BLOCK_SIZE  # "auto": chosen each cycle; an int: fixed
    # Draft trees of a request decoded alone (0: linear blocks; N: trees of N nodes; "auto": as `auto` weighs
    # them); a batched request verifies linear blocks (`scheduler.Scheduler._new_batch`).
    tree_budget: int | str = DEFAULT_TREE_BUDGET
    tree_shape: str = DEFAULT_TREE_SHAPE  # "spine" or "paper" (`decoding.tree`)
    prompt_cache_bytes: int | None = None  # None: sized from the device's memory (`runtime.default_prompt_cache_bytes`)
    calibration: Any = None  # seeds `auto` with this machine's measured cycle costs (`mlx_dflash.auto.calibration`)
    prompt_lookup: bool = True  # also propose tokens read off the prompt (`mlx_dflash.proposers.lookup`)
    max_queue: int = 32  # requests waiting behind the running ones before new ones are refused (0: no bound)
    max_batch: int = 8  # requests decoded together (1: one at a time)
    batch_bytes: int | None = None  # memory for the batched caches (None: `runtime.default_batch_bytes`)
    buffer_cache_bytes: int | None = None  # freed MLX buffers kept for reuse (None: an eighth of batch_bytes)
    prompt_cache_dir: str | None = None  # the prompt cache's disk tier (`prompt_disk`; None: memory only)
    prompt_cache_disk_bytes: int | None = None  # its bound (None: `prompt_disk.default_disk_bytes`; 0: no disk tier)


BUFFER_CACHE_MIN = 64 << 20  # a cycle's activations of a small model, reused without a new allocation
PERSIST_WAIT = 120.0  # seconds `stop` also waits while the worker writes the live conversations to disk


class QueueFull(Exception):
    """The engine's queue holds `max_queue` requests already."""


class Engine:
    def __init__(self, target: TargetModel | Any, tokenizer: Any, drafter: Any | None = None,
                 config: EngineConfig | None = None):
        self.target = target if isinstance(target, TargetModel) else TargetModel(target)
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.config = config or EngineConfig()
        lookup = self.config.prompt_lookup
        self.max_block_size = check_block_size(None, drafter, lookup=lookup)
        size = self.config.block_size
        if drafter is None and not lookup:
            size = 1
        self.block_size = size if size == AUTO else check_block_size(int(size), drafter, lookup=lookup)
        # An explicit tree budget this pair cannot verify is refused here, before serving anything.
        self.tree_budget, self.tree_shape = tree_settings(
            self.config.tree_budget, self.config.tree_shape, self.target,
            make_proposer(self.target, drafter, self.max_block_size))
        # Every request forks it (`auto.policy.fork`): the costs on this machine hold across them. A request
        # decoded alone verifies trees as it says; a batched one never does (`scheduler.Scheduler._new_batch`).
        self.policy = make_policy(self.block_size, self.max_block_size, self.config.calibration,
                                  drafter=drafter is not None, lookup=lookup, tree_budget=self.tree_budget,
                                  tree_shape=self.tree_shape)
        self.max_context = getattr(self.target.args, "max_position_embeddings", None)
        self.stop_ids = set(tokenizer.eos_token_ids)
        cache_bytes = self.config.prompt_cache_bytes
        if cache_bytes is None:
            cache_bytes = default_prompt_cache_bytes(self.target.model, drafter)
        self.prompt_cache = PromptCache(cache_bytes, self._new_session, turn_openers(tokenizer))
        if self.config.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.config.max_batch}")
        self.footprint = batch_footprint(self.target, drafter, self.max_block_size)
        self.batch_bytes = self.config.batch_bytes
        if self.batch_bytes is None:
            self.batch_bytes = default_batch_bytes(cache_bytes, self.target.model, drafter)
        self.buffer_cache_bytes = self.config.buffer_cache_bytes
        if self.buffer_cache_bytes is None:
            self.buffer_cache_bytes = max(self.batch_bytes // 8, BUFFER_CACHE_MIN)
        # The worker thread decodes: nothing it reads may hold a graph built on this thread.
        settle(self.target.model, drafter)
        disk_bytes = self.config.prompt_cache_disk_bytes
        if self.config.prompt_cache_dir and cache_bytes > 0 and disk_bytes != 0:
            self.prompt_cache.disk = PromptDisk.for_models(self.config.prompt_cache_dir, disk_bytes, self.target,
                                                           drafter)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._scheduler: Scheduler | None = None

    def _new_session(self) -> DecodingSession:
        return DecodingSession(self.target, make_proposer(self.target, self.drafter, self.max_block_size),
                               lookup=make_lookup(self.config.prompt_lookup))

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="dflash-decode", daemon=True)
            self._thread.start()

    def cancel_all(self) -> None:
        """End every request: the running ones at their cycle's end, the queued ones now (each gets a Finished)."""
        pending = []
        while True:
            try:
                pending.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            if job is not None:
                job.cancelled.set()
                job.emit(Finished("cancelled", GenerationStats()))
        if self._scheduler is not None:
            self._scheduler.cancel_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every request and end the worker, which first writes the live conversations to
        the prompt cache's disk tier, if there is one."""
        if self._thread is None:
            return
        self.cancel_all()
        self._jobs.put(None)
        self._thread.join(timeout + (PERSIST_WAIT if self.prompt_cache.disk is not None else 0))
        self._thread = None
        self.prompt_cache.clear()

    def submit(self, request: GenerationRequest, emit: Callable[[Step | Finished], None]) -> Job:
        """Queue a request; raises `QueueFull` when `max_queue` wait already (only one thread submits)."""
        bound = self.config.max_queue
        if bound and self.waiting >= bound:
            raise QueueFull(f"{self.waiting} requests are waiting (--max-queue {bound})")
        job = Job(request, emit)
        self._jobs.put(job)
        return job

    @property
    def waiting(self) -> int:
        """Live requests not admitted yet (a cancelled one holds no place: the worker drops it)."""
        scheduler = self._scheduler
        # list() of a deque copies it in C, holding the GIL: safe beside the worker's changes.
        jobs = list(self._jobs.queue) + (list(scheduler.waiting) if scheduler is not None else [])
        return sum(job is not None and not job.cancelled.is_set() for job in jobs)

    @property
    def busy(self) -> bool:
        """Some request is being decoded."""
        return self._scheduler is not None and bool(self._scheduler.runs)

    @property
    def batching(self) -> dict[str, Any]:
        """Requests running, how many of them are batched, and the batch's widths so far."""
        return describe_batch(self._scheduler, self.config.max_batch)

    @property
    def prefilling(self) -> list[dict[str, Any]]:
        """Each prefill under way: positions fed of those to feed, and seconds so far (plain values)."""
        return describe_prefill(self._scheduler)

    @property
    def _current(self) -> Job | None:
        """The oldest running request's job (None: idle)."""
        runs = self._scheduler.runs if self._scheduler is not None else []
        return runs[0].job if runs else None

    # -- the worker ----------------------------------------------------------------------
    def _work(self) -> None:
        self._scheduler = Scheduler(self, self._jobs)
        with wired_limit([self.target.model, self.drafter]), buffer_cache_limit(self.buffer_cache_bytes):
            self._scheduler.serve()
            self.prompt_cache.persist()  # on this thread, where the sessions' arrays were made
