"""The decode worker's loop: up to `max_batch` requests advance together, one cycle at a time.

Each request is a `Run`: its session (from the prompt cache) and its `stream_session`
stream, pulled one event per cycle. Requests that can be batched (`batching.batch.refusal`: plain
K/V caches, a v1 drafter; no grammar, no seeded sampling) join a `SessionBatch` once
prefilled, at a cycle boundary, whenever another one is running: each loop the batch runs
one cycle for all of them and every stream then emits its part. The others advance in turn,
one cycle each per loop (sliding-window and hybrid targets: every request that way). A batch
left with one row hands it back to decode alone, with launching ahead and prompt lookup.

A new request is prefilled at the end of a loop, in 512-token chunks; between its chunks the
running requests go on and newly arrived ones are admitted and prefilled (so a long prompt
stalls neither). Admission keeps to `max_batch` and to a memory budget for the batched caches
(`batching.batch.BatchFootprint`: every row as long as the longest, a layer's copy in flight). A
seeded sampled request draws from MLX's global generator as it would alone: it is not run beside
another sampled request (greedy ones draw nothing), so its sample repeats exactly; sampled
requests behind one that waits for that wait too, so no request waits for ever. Cancelled
requests leave the queue at once, wherever they wait. Each request's `auto` policy is its own
fork of the engine's (`auto.policy.fork`).

A failure is its request's alone: one request's clean-up (keeping its conversation) or a
failure between another's prefill chunks ends no other request.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Any, Protocol

import mlx.core as mx

from ...auto.policy import absorb, fork, make_policy, reproducible
from ...batching.batch import BatchFootprint, SessionBatch, refusal
from ...decoding.block_size import BlockSizePolicy, FixedBlockSize
from ...decoding.loop import GenerationEvent, stream_session
from ...decoding.sampling import make_sampler
from ...decoding.stats import GenerationStats
from ...decoding.stream_guard import end_stream
from ...targets.model import TargetModel
from .jobs import Finished, Job, Step, token_logprobs
from .prefill_progress import PrefillProgress
from .prompt_cache import PromptCache, recover, until_cancelled
from .text import TextFilter

logger = logging.getLogger("mlx_dflash")
SHARED_PREFILL_CHUNK = 512  # prompt positions per prefill forward while other requests may be running


class EngineView(Protocol):
    """What the scheduler reads of the engine that runs it (`engine.Engine`): the models, the
    shared policy and prompt cache, and the limits. The engine owns the thread and the queue."""

    target: TargetModel
    tokenizer: Any
    drafter: Any
    config: Any  # its `EngineConfig`: `max_batch`
    policy: BlockSizePolicy
    block_size: int | str
    max_block_size: int
    stop_ids: set[int]
    prompt_cache: PromptCache
    footprint: BatchFootprint  # what the batched caches take per row and position
    batch_bytes: int  # what the batched caches may take


class Run:
    """One request being decoded: its session, its event stream and its text so far."""

    def __init__(self, engine: EngineView, job: Job):
        req = job.request
        self.engine, self.job = engine, job
        self.sampled = req.temperature > 0
        self.seeded = self.sampled and req.seed is not None
        # What may refuse the request comes before a cached session is taken over (or a failure drops it).
        if self.seeded:  # (a greedy request's seed would only disturb a seeded sample running beside it)
            mx.random.seed(req.seed)
        self.sampler = make_sampler(req.temperature, top_p=req.top_p, min_p=req.min_p, top_k=req.top_k)
        self.policy = fork(reproducible(engine.policy, engine.max_block_size, req.seed, req.temperature))
        self.text = TextFilter(req.stops)
        self.constrained = req.constraint is not None
        constraint = req.constraint() if req.constraint is not None else None
        self.session, self.cached = engine.prompt_cache.fetch(req.prompt)
        self.session.cancel_check = job.cancelled.is_set  # a cancelled request's prefill stops at its next chunk
        new = req.prompt[len(self.session.tokens):]
        engine.prompt_cache.mark(self.session, new)
        self.prompt_tokens = len(new)
        # What its prefill has computed so far (/health, the log); it computes the pending token too.
        self.progress = PrefillProgress(len(new) + min(len(self.session.tokens), 1))
        self.session.progress = self.progress
        stream = stream_session(self.session, new, self.sampler, max_tokens=req.max_tokens, stop=engine.stop_ids,
                                detokenizer=engine.tokenizer.detokenizer, policy=self.policy, constraint=constraint)
        self.stream = until_cancelled(stream)
        self.end = len(req.prompt) + req.max_tokens  # positions it may reach
        self.refused: str | None = None  # why the batch does not take it ("": it does; None: not asked yet)
        self.prefilling = False  # its prefill is under way (others run between its chunks)
        self.event: GenerationEvent | None = None
        self.finish, self.stop = "cancelled", None

    @property
    def started(self) -> bool:
        """Prefilled: its first event is out, and it is between cycles."""
        return self.event is not None

    def why_alone(self) -> str | None:
        """Why this request decodes alone rather than in the batch (None: it may join); asked once
        it is prefilled, and fixed from then on."""
        if self.refused is None:
            if self.constrained:
                self.refused = "structured output reads each draft on the host"
            elif self.seeded:
                self.refused = "a seeded sample repeats only as drawn alone"
            else:
                self.refused = refusal(self.session) or ""
        return self.refused or None

    def advance(self) -> Finished | None:
        """Pull and emit the next event; the `Finished` (not emitted yet) once the request is done."""
        if self.event is None:
            self.progress.begin()  # this call prefills
        event = next(self.stream, None)
        if event is None:  # the stream ended early: a prefill cancelled between chunks
            return self._finished()
        self.event = event
        self.session.progress = None
        released = self.text.push(event.text)
        top = self.job.request.top_logprobs
        logprobs = None if top is None else token_logprobs(event.logprobs, event.tokens, top)
        self.job.emit(Step(event.tokens, released.text, logprobs))
        if released.stop is not None:
            self.finish, self.stop = "stop", released.stop
        elif event.finish_reason:
            self.finish = event.finish_reason
        elif not self.job.cancelled.is_set():
            return None
        return self._finished()

    def _finished(self) -> Finished:
        if self.finish in ("stop", "length") and self.stop is None:
            tail = self.text.flush()
            if tail:
                self.job.emit(Step([], tail))
        stats = self.event.stats if self.event is not None else GenerationStats(prompt_tokens=self.prompt_tokens)
        return Finished(self.finish, stats, self.cached, self.stop)

    def close(self, consistent: bool) -> None:
        """End the stream and keep the session for later requests (if it is consistent, or can be made so)."""
        session = self.session
        absorb(self.engine.policy, self.policy)
        if session.batch is not None:
            session.batch.remove(session)
        end_stream(self.stream, self._store, consistent)

    def _store(self, consistent: bool) -> None:
        session = self.session
        session.cancel_check = session.between_chunks = session.progress = None
        # A failed request keeps its conversation: a session the error left mid-cycle is cut back.
        if consistent or recover(session):
            self.engine.prompt_cache.store(session)


class Scheduler:
    """The worker's loop over the engine's queue (runs on the decode thread only)."""

    def __init__(self, engine: EngineView, jobs: queue.Queue[Job | None]):
        self.engine = engine
        self.jobs = jobs  # the engine's queue; None asks the loop to end
        self.runs: list[Run] = []
        self.waiting: deque[Job] = deque()  # taken off the queue, not admitted yet
        self.batch = self._new_batch()
        self._explained: set[str] = set()
        self.peak = 0  # the most requests running at once
        self.stopping = False  # the engine's stop arrived: end once every request has

    def _new_batch(self) -> SessionBatch:
        engine = self.engine
        size = engine.block_size
        # Its own costs and acceptance: a batched cycle's cost per row is not a lone cycle's. Linear blocks
        # only, whatever the engine's tree budget: the batch asks its policy without offering trees
        # (`SessionBatch` passes no `TREE` offer), and a member's `session.cycle` returns its part of the
        # batch's cycle before offering any. A request decoded alone (one running, or one the batch refused
        # or handed back) cycles with its own fork of `engine.policy`, trees included.
        policy = (make_policy(size, engine.max_block_size, tree_budget=0) if engine.drafter is not None
                  else FixedBlockSize(1))
        return SessionBatch(engine.target, policy)

    @property
    def max_batch(self) -> int:
        return self.engine.config.max_batch

    def serve(self) -> None:
        """Until the engine's stop: admit, run one cycle of everything running, prefill the new."""
        while not self.stopping or self.runs or self.waiting:
            self._take(block=not self.runs and not self.waiting)
            try:
                self._admit()
                self._cycle()
                self._prefill()
                self._regroup()
            except Exception as e:  # noqa: BLE001 - a bug here must not leave every client waiting for ever
                logger.exception("mlx-dflash serve: the decode loop failed; ending the running requests")
                self._fail(list(self.runs), e)

    def cancel_all(self) -> None:
        """Called from another thread: mark every admitted and waiting request cancelled."""
        for job in [run.job for run in list(self.runs)] + list(self.waiting):
            job.cancelled.set()

    # -- admission -------------------------------------------------------------------------
    def _take(self, block: bool) -> None:
        """Move queued jobs to `waiting` (waiting for one when idle); note the stop (a None)."""
        try:
            job = self.jobs.get() if block else self.jobs.get_nowait()
            while True:
                if job is None:
                    self.stopping = True
                else:
                    self.waiting.append(job)
                job = self.jobs.get_nowait()
        except queue.Empty:
            return

    def _admit(self) -> None:
        self._purge()
        held = False  # a sampled request waits for the generator: the sampled ones behind it wait too
        for job in list(self.waiting):
            if len(self.runs) >= self.max_batch or not self._fits(job):
                break  # in arrival order: a large request is not overtaken for ever
            if job.request.temperature > 0 and (held or self._draws_beside(job)):
                held = True
                continue
            self.waiting.remove(job)
            try:
                run = Run(self.engine, job)
            except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
                job.emit(Finished("error", GenerationStats(), error=f"{type(e).__name__}: {e}"))
                continue
            run.session.between_chunks = self._between_chunks
            if self.max_batch > 1:  # finer chunks: the running requests wait at most one chunk for a cycle
                run.session.prefill_chunk = min(run.session.prefill_chunk, SHARED_PREFILL_CHUNK)
            self.runs.append(run)
            self.peak = max(self.peak, len(self.runs))

    def _purge(self) -> None:
        """End every cancelled waiting request now: one that will never run must not hold a place."""
        for job in [job for job in self.waiting if job.cancelled.is_set()]:
            self.waiting.remove(job)
            job.emit(Finished("cancelled", GenerationStats(prompt_tokens=len(job.request.prompt))))

    def _draws_beside(self, job: Job) -> bool:
        """A seeded sample must not share the generator with another sampled request."""
        req = job.request
        if req.temperature <= 0:
            return False
        seeded = req.seed is not None
        return any(run.sampled and (seeded or run.seeded) for run in self.runs)

    def _fits(self, job: Job) -> bool:
        if not self.runs:
            return True
        ends = [run.end for run in self.runs] + [len(job.request.prompt) + job.request.max_tokens]
        return self.engine.footprint.peak(len(ends), max(ends)) <= self.engine.batch_bytes

    # -- decoding ----------------------------------------------------------------------------
    def _cycle(self) -> None:
        """One cycle of every running request: the batch's in one, the others' each alone."""
        if len(self.batch):
            try:
                self.batch.step()
            except Exception as e:  # noqa: BLE001 - the batch's rows fail together; the others go on
                self._fail([run for run in self.runs if run.session.batch is self.batch], e)
        for run in [r for r in self.runs if r.started]:
            if run in self.runs:
                self._advance(run)

    def _prefill(self) -> None:
        """Prefill the admitted requests, in arrival order (the running ones go on between chunks)."""
        for run in list(self.runs):
            if run in self.runs and not run.started and not run.prefilling:
                run.prefilling = True
                try:
                    self._advance(run)
                finally:
                    run.prefilling = False

    def _between_chunks(self) -> None:
        """Between a long prompt's chunks: newly arrived requests are admitted and prefilled (a short
        prompt does not wait behind a long one), and every running request takes a cycle."""
        try:
            self._take(block=False)
            self._admit()
            self._prefill()
            self._cycle()
            self._regroup()
        except Exception as e:  # noqa: BLE001 - not the prefilled request's fault: it goes on
            logger.exception("mlx-dflash serve: the decode loop failed between prefill chunks; ending the "
                             "running requests")
            self._fail([run for run in self.runs if not run.prefilling], e)

    def _advance(self, run: Run) -> None:
        try:
            finished, consistent = run.advance(), True
        except Exception as e:  # noqa: BLE001 - never let one request take the worker down
            finished, consistent = Finished("error", GenerationStats(), error=f"{type(e).__name__}: {e}"), False
        if finished is None:
            return
        self.runs.remove(run)
        try:
            run.close(consistent)
        except Exception:  # noqa: BLE001 - the reply is whole; only its conversation is not kept
            logger.exception("mlx-dflash serve: a finished request's conversation could not be kept")
        finally:
            run.job.emit(finished)

    def _fail(self, runs: list[Run], error: Exception) -> None:
        """End `runs` with the error; a batch they were in starts afresh (their sessions are not kept)."""
        self.batch = self._new_batch()
        for run in runs:
            self.runs.remove(run)
            run.session.batch = None  # its caches went with the batch, or its state is unknown
            try:
                run.stream.close()
            except Exception:  # noqa: BLE001, S110 - a broken stream still ends its request
                pass
            run.job.emit(Finished("error", GenerationStats(), error=f"{type(error).__name__}: {error}"))

    def _regroup(self) -> None:
        """Batch the batchable running requests when two or more run; hand a lone row back."""
        if self.max_batch < 2:
            return
        ready = []
        for run in self.runs:
            if not run.started or run.session.batch is not None:
                continue
            reason = run.why_alone()
            if reason is None:
                ready.append(run)
            elif reason not in self._explained and len(self.runs) > 1:
                self._explained.add(reason)
                logger.warning("mlx-dflash serve: a request decodes alone, beside the batch: %s", reason)
        if ready and len(self.batch) + len(ready) >= 2:
            for run in ready:
                try:
                    self.batch.add(run.session, run.sampler, self.engine.stop_ids,
                                   run.job.request.max_tokens - run.event.stats.num_tokens)
                except Exception as e:  # noqa: BLE001 - it decodes alone; the batch is as it was
                    run.refused = f"{type(e).__name__}: {e}"
        elif len(self.batch) == 1:
            self.batch.remove(self.batch.rows[0].session)


def describe_batch(scheduler: Scheduler | None, max_batch: int) -> dict[str, Any]:
    """Requests running, how many are batched, and the batched cycles per width so far (for /health)."""
    if scheduler is None:
        return {"max_batch": max_batch, "running": 0, "batched": 0, "cycles_by_width": {}}
    return {"max_batch": max_batch, "running": len(scheduler.runs), "batched": len(scheduler.batch),
            "cycles_by_width": {str(w): n for w, n in sorted(scheduler.batch.widths.items())}}
