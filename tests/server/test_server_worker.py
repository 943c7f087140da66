"""The decode worker under load: the batch within its memory budget (copies included), cancelled
requests leaving the queue wherever they wait, no request waiting for ever, each request's own
`auto` state, and failures that stay with the request they belong to."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from helpers.engine_runs import Reply, expected, prompts, serve_all
from helpers.serverkit import tiny_pair
from helpers.tiny import FakeTokenizer

from mlx_dflash.auto.policy import AutoBlockSize
from mlx_dflash.batching.batch import SessionBatch, batch_footprint
from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.base import DFLASH
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.server import Engine, EngineConfig
from mlx_dflash.server.worker import scheduler as scheduler_module
from mlx_dflash.server.worker.jobs import Finished, GenerationRequest
from mlx_dflash.server.worker.prompt_cache import PromptCache
from mlx_dflash.targets.model import TargetModel


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("worker"))


def allocated(batch: SessionBatch) -> int:
    """Bytes the batch's caches hold now."""
    return sum(c.nbytes for c in batch.cache) + (batch.draft.nbytes if batch.draft is not None else 0)


# -- memory ---------------------------------------------------------------------------------------
def test_admission_keeps_to_the_budget_at_its_edge(pair):
    target, tokenizer, drafter = pair
    requests = [GenerationRequest(p, n) for p, n in zip(prompts(7, (300, 20)), (30, 30), strict=True)]
    footprint = batch_footprint(TargetModel(target), drafter, 8)
    edge = footprint.peak(2, max(len(r.prompt) + r.max_tokens for r in requests))
    for budget, most in ((edge, 2), (edge - 1, 1)):
        engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4, block_size=8, batch_bytes=budget))
        replies = serve_all(engine, [GenerationRequest(r.prompt, r.max_tokens) for r in requests])
        assert engine._scheduler.peak == most, budget
        assert bool(engine._scheduler.batch.widths) == (most == 2)
        for reply, request in zip(replies, requests, strict=True):
            assert reply.tokens == expected(target, request)


def test_the_batch_gives_back_a_long_row_and_stays_within_its_budget(pair, monkeypatch):
    """A long request batched beside a short one, then short ones joining once it is done: the
    buffers shrink when the long row leaves, so every cycle's caches keep to --batch-bytes."""
    target, tokenizer, drafter = pair
    long_prompt, *shorts = prompts(8, (600, 8, 9, 10, 11))
    requests = [GenerationRequest(long_prompt, 4)] + [GenerationRequest(p, 80) for p in shorts]
    footprint = batch_footprint(TargetModel(target), drafter, 8)
    budget = footprint.peak(2, len(long_prompt) + 4)
    seen, real_step = [], SessionBatch.step

    def step(self):
        real_step(self)
        seen.append((len(self), allocated(self)))

    monkeypatch.setattr(SessionBatch, "step", step)
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4, block_size=8, batch_bytes=budget))
    replies = serve_all(engine, requests)
    for reply, request in zip(replies, requests, strict=True):
        assert reply.tokens == expected(target, request)
    assert max(width for width, _ in seen) >= 3  # the short ones were batched after the long one left
    assert max(size for _, size in seen) <= budget


def members(target, drafter, lengths: tuple[int, ...]) -> list[DecodingSession]:
    """Sessions prefilled on prompts of `lengths`, between cycles, ready to join a batch."""
    sessions = []
    for prompt in prompts(9, lengths):
        session = DecodingSession(target, make_proposer(target, drafter, 8))
        stream = stream_session(session, prompt, make_sampler(0.0), max_tokens=4, stop=set(),
                                detokenizer=FakeTokenizer(eos_token_ids=()).detokenizer, policy=FixedBlockSize(8))
        next(stream)
        session.settle()
        session.inject_pending()  # what joining does first, done here: the test measures the copies
        mx.eval(session.proposer.state_arrays(), [c.state for c in session.cache])
        sessions.append(session)
    return sessions


def test_a_join_and_a_leave_copy_one_layer_at_a_time(pair):
    target, _, drafter = pair
    target = TargetModel(target)
    footprint = batch_footprint(target, drafter, 8)
    batch = SessionBatch(target, FixedBlockSize(8))
    sessions = members(target, drafter, (700, 500, 300, 100))
    for session in sessions[:3]:
        batch.add(session, make_sampler(0.0), set(), 4)
    held = allocated(batch)
    slots = batch.cache[0].keys.shape[2]
    assert held == 3 * slots * footprint.token_bytes
    assert footprint.peak(3, 700) >= held + 3 * slots * footprint.layer_bytes
    one_layer = (len(batch) + 1) * slots * footprint.layer_bytes
    for change in (lambda: batch.add(sessions[3], make_sampler(0.0), set(), 4),
                   lambda: batch.remove(sessions[0])):
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        change()
        # In flight: the row that moves and one layer's copies, not a second copy of the batch.
        assert mx.get_peak_memory() - before <= slots * footprint.token_bytes + 2 * one_layer < held
    # The 700-token row left: every buffer shrank to what the others hold.
    assert batch.cache[0].keys.shape[2] == 512 and allocated(batch) == 3 * 512 * footprint.token_bytes


# -- the queue ------------------------------------------------------------------------------------
def test_cancelled_requests_leave_the_queue_wherever_they_wait(pair):
    target, tokenizer, drafter = pair
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=1, max_queue=3, block_size=8))
    log: list = []
    replies = [Reply(str(i), log) for i in range(4)]
    requests = [GenerationRequest(p, n) for p, n in zip(prompts(10, (5, 6, 7, 8)), (300, 5, 5, 5), strict=True)]
    jobs = [engine.submit(r, reply) for r, reply in zip(requests[:3], replies[:3], strict=True)]
    engine.start()
    try:
        while not replies[0].steps:
            replies[0].done.wait(0.005)
        jobs.append(engine.submit(requests[3], replies[3]))  # the queue is full: 3 wait behind the first
        jobs[2].cancelled.set()
        jobs[3].cancelled.set()
        assert engine.waiting == 1  # the cancelled ones hold no place
        engine.submit(GenerationRequest(requests[1].prompt, 5), Reply("4", log))  # within --max-queue 3
        for reply in replies[2:]:
            assert reply.done.wait(60)
        assert not replies[0].done.is_set() and not replies[1].steps  # ended while the first still runs
        assert [r.finished.finish_reason for r in replies[2:]] == ["cancelled", "cancelled"]
        assert replies[0].done.wait(120) and replies[1].done.wait(60)
    finally:
        engine.stop()


def test_a_seeded_sample_is_not_overtaken_by_later_samples(pair):
    target, tokenizer, drafter = pair
    first, seeded, *later = prompts(11, (6, 7, 8, 9))
    requests = [GenerationRequest(first, 40, temperature=0.8),
                GenerationRequest(seeded, 10, temperature=0.8, seed=5),
                GenerationRequest(later[0], 10, temperature=0.8),
                GenerationRequest(later[1], 10, temperature=0.8)]
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4, block_size=8))
    serve_all(engine, requests)
    order = [name for name, kind in engine.log if kind == "Step"]
    assert order.index("1") < order.index("2") and order.index("1") < order.index("3")


# -- the policy -----------------------------------------------------------------------------------
def test_each_request_decodes_with_its_own_auto_state_and_the_shared_costs(pair, monkeypatch):
    target, tokenizer, drafter = pair
    policies, real_init = [], scheduler_module.Run.__init__

    def init(self, engine, job):
        real_init(self, engine, job)
        policies.append(self.policy)

    monkeypatch.setattr(scheduler_module.Run, "__init__", init)
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=1, block_size="auto", prompt_lookup=False))
    requests = [GenerationRequest(p, 20) for p in prompts(12, (10, 12))]
    for reply, request in zip(serve_all(engine, requests), requests, strict=True):
        assert reply.tokens == expected(target, request)
    shared = engine.policy
    assert isinstance(shared, AutoBlockSize) and len(policies) == 2
    assert all(p is not shared for p in policies) and policies[0] is not policies[1]
    assert all(p.sources[DFLASH].costs is shared.sources[DFLASH].costs for p in policies)
    # What the last one learnt seeds the next request.
    assert shared.acceptance.reached == policies[-1].acceptance.reached and shared.acceptance.evidence > 0


# -- failures -------------------------------------------------------------------------------------
def test_a_failed_clean_up_ends_no_other_request(pair, monkeypatch):
    target, tokenizer, drafter = pair
    real_store, calls = PromptCache.store, []

    def store(self, session):
        calls.append(len(session.tokens))
        if len(calls) == 1:
            raise MemoryError("out of memory keeping a conversation (simulated)")
        real_store(self, session)

    monkeypatch.setattr(PromptCache, "store", store)
    requests = [GenerationRequest(p, n) for p, n in zip(prompts(13, (9, 30, 14)), (6, 40, 40), strict=True)]
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4, block_size=8))
    replies = serve_all(engine, requests)
    assert len(calls) == 3 and all(r.finished.finish_reason in ("stop", "length") for r in replies)
    for reply, request in zip(replies, requests, strict=True):
        assert reply.tokens == expected(target, request)


def test_a_failure_between_prefill_chunks_is_not_the_prefilled_requests(pair, monkeypatch):
    target, tokenizer, drafter = pair
    monkeypatch.setattr(scheduler_module, "SHARED_PREFILL_CHUNK", 32)
    real_regroup, failed = scheduler_module.Scheduler._regroup, threading.Event()

    def regroup(self):
        if any(run.prefilling for run in self.runs) and not failed.is_set():
            failed.set()
            raise RuntimeError("a bug between chunks (simulated)")
        real_regroup(self)

    monkeypatch.setattr(scheduler_module.Scheduler, "_regroup", regroup)
    requests = [GenerationRequest(p, n) for p, n in zip(prompts(14, (6, 200)), (60, 8), strict=True)]
    engine = Engine(target, tokenizer, drafter, EngineConfig(max_batch=4, block_size=8))
    replies = serve_all(engine, requests)
    assert failed.is_set()
    assert replies[1].finished.finish_reason == "length" and replies[1].tokens == expected(target, requests[1])
    assert replies[0].finished.finish_reason == "error" and "between chunks" in replies[0].finished.error


def test_freed_buffers_kept_for_reuse_are_bounded_while_serving(pair):
    """MLX keeps every freed buffer by default: a server whose requests come and go would hold
    memory that no budget counts, so the worker bounds that cache while it serves."""
    target, tokenizer, drafter = pair
    engine = Engine(target, tokenizer, drafter, EngineConfig(batch_bytes=256 << 20))
    assert engine.buffer_cache_bytes == 64 << 20  # an eighth of the batch's budget, at least 64 MiB
    engine = Engine(target, tokenizer, drafter, EngineConfig(buffer_cache_bytes=3 << 20))
    seen, done = [], threading.Event()

    def emit(item):
        if not seen:  # on the worker thread, while it serves: read the limit (setting it back at once)
            seen.append(mx.set_cache_limit(1 << 20))
            mx.set_cache_limit(seen[0])
        if isinstance(item, Finished):
            done.set()

    outside = mx.set_cache_limit(5 << 30)
    try:
        engine.submit(GenerationRequest(prompts(15, (6,))[0], 4), emit)
        engine.start()
        assert done.wait(60)
    finally:
        engine.stop()
        after = mx.set_cache_limit(outside)
    assert seen == [3 << 20] and after == 5 << 30  # bounded while serving, restored after
