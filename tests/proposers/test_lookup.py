"""Prompt lookup: the n-gram index, and exact decoding with its proposals on every family.

The index is checked against a brute-force search over every prefix of random
sequences (and after rollbacks and copies). Decoding with lookup proposals must equal
the target alone: greedy on every family (dense, MoE, hybrid recurrent, sliding window),
beside a DFlash drafter and alone; sampled, every token must follow the target's
distribution. Random tiny targets rarely repeat their context, so the family tests also
run a lookup whose proposals come from the known continuation with errors (every
acceptance length occurs, and rollbacks run) through the same session path.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.distributions import P_BROKEN, P_HONEST, pit_pvalue
from helpers.families import FAMILIES, HYBRID_CONFIGS, build
from helpers.tiny import VOCAB, FakeTokenizer, ScriptedProposer, greedy_reference, tiny_drafter

import mlx_dflash
from mlx_dflash.auto.policy import AutoBlockSize
from mlx_dflash.decoding import session as session_module
from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.base import DFLASH, LOOKUP
from mlx_dflash.proposers.lookup import PromptLookup
from mlx_dflash.targets.model import TargetModel

GREEDY = make_sampler(0.0)


def brute_force(tokens: list[int], limit: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The longest suffix n-gram's most recent earlier occurrence, continued (periodically past the end)."""
    last = len(tokens) - 1
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                extended = list(tokens)
                while len(extended) < end + 1 + limit:
                    extended.append(extended[len(extended) - (last - end)])
                return extended[end + 1 : end + 1 + limit]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_index_proposes_what_a_search_finds(seed):
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 3 + seed, 300)]  # small vocabularies: many matches
    lookup = PromptLookup()
    for length in range(1, len(tokens) + 1):
        limit = int(rng.integers(1, 16))
        assert lookup.propose(tokens[:length], limit) == brute_force(tokens[:length], limit), (length, limit)


def test_a_period_is_continued():
    lookup = PromptLookup()
    assert lookup.propose([9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert lookup.propose([9, 1, 2, 1, 2, 7, 7, 7], 3) == [7, 7, 7]
    assert PromptLookup().propose([1, 2, 3, 4], 4) == []  # nothing repeats


def test_truncate_and_copy_leave_the_index_a_fresh_one_would_build():
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, 5, 200)]
    lookup = PromptLookup()
    lookup.sync(tokens)
    clone = lookup.copy()
    for length in (150, 151, 60, 2, 1):
        lookup.truncate(tokens, length)
        tokens = tokens[:length]
        fresh = PromptLookup()
        fresh.sync(tokens)
        assert lookup._ends == fresh._ends, length
        grown = tokens + [int(t) for t in rng.integers(0, 5, 30)]
        assert lookup.copy().propose(grown, 8) == brute_force(grown, 8)
    assert sum(len(v) for v in clone._ends.values()) == 198 + 197 + 196  # the copy kept its own index (n = 2, 3, 4)


class OracleLookup(PromptLookup):
    """The known continuation, each token wrong at `error_rate`: every acceptance length occurs."""

    def __init__(self, sequence: list[int], error_rate: float, seed: int, miss: float = 0.0):
        super().__init__()
        self.sequence, self.error_rate, self.miss = sequence, error_rate, miss  # miss: chance of no match
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens, limit):
        super().propose(tokens, limit)  # the index is kept as the real one keeps it
        if self.rng.random() < self.miss:
            return []
        out = list(self.sequence[len(tokens) : len(tokens) + limit])
        return [t if self.rng.random() >= self.error_rate else (t + 1) % VOCAB for t in out]


class GreedyLookup(PromptLookup):
    """Proposes the target's most likely next token, repeated: often sampled, often not."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def propose(self, tokens, limit):
        super().propose(tokens, limit)
        guess = mx.argmax(self.model(mx.array([tokens], dtype=mx.uint32))[0, -1]).item()
        return [guess] * limit


def decode(model, prompt, max_tokens, lookup, proposer=None, policy=None, sampler=GREEDY) -> tuple[list[int], dict]:
    session = DecodingSession(TargetModel(model), proposer, lookup=lookup)
    policy = policy or FixedBlockSize(6)
    events = list(stream_session(
        session, prompt, sampler, max_tokens=max_tokens, stop=set(), detokenizer=FakeTokenizer().detokenizer,
        policy=policy))
    return [t for e in events for t in e.tokens], events[-1].stats


ALL_FAMILIES = sorted(set(FAMILIES) | set(HYBRID_CONFIGS))


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_greedy_with_lookup_proposals_equals_the_target_alone(model_type):
    model = build(model_type, seed=1)
    prompt = [(13 * i + 5) % VOCAB for i in range(12)]
    reference = greedy_reference(model, prompt, 40)
    for error_rate, seed in ((0.0, 0), (0.3, 1), (1.0, 2)):
        lookup = OracleLookup(prompt + reference + [0] * 16, error_rate, seed)
        tokens, stats = decode(model, prompt, 40, lookup)
        assert tokens == reference, (error_rate, seed)
        assert stats.cycles_by_source.get(LOOKUP, 0) > 0
        if error_rate == 0.0:
            assert max(stats.acceptance_lengths) == 6
        if error_rate == 1.0:
            assert stats.accepted_by_source[LOOKUP] == 0


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5", "gemma3_text"])
def test_lookup_beside_a_drafter_is_exact_and_both_are_used(model_type):
    """`auto` with both sources; the drafter is a scripted one that is often wrong, the lookup
    an oracle: both propose, the session hands the drafter every position either way."""
    model = build(model_type, seed=1)
    prompt = [(7 * i + 3) % VOCAB for i in range(10)]
    reference = greedy_reference(model, prompt, 60)
    drafter = ScriptedProposer(prompt + reference + [0] * 16, VOCAB, error_rate=0.5, seed=3,
                               target_layer_ids=[0, 2])
    lookup = OracleLookup(prompt + reference + [0] * 16, 0.0, 0, miss=0.5)
    policy = AutoBlockSize(8, lookup=True)
    tokens, stats = decode(model, prompt, 60, lookup, drafter, policy)
    assert tokens == reference  # (the scripted drafter asserts it was handed every position)
    assert stats.cycles_by_source.get(LOOKUP, 0) > 0 and stats.cycles_by_source.get(DFLASH, 0) > 0


def test_a_real_drafter_beside_the_real_index_stays_exact():
    """Chunked prefill, the real index, a real tiny DFlash drafter, `auto`: equal to the target alone."""
    model = build("qwen3", seed=2)
    drafter = tiny_drafter(model, block_size=8)
    prompt = [int(t) for t in np.random.default_rng(0).integers(4, VOCAB, 30)] * 2
    reference = greedy_reference(model, prompt, 120)
    tokens = [t for e in mlx_dflash.stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt,
                                                    draft_model=drafter, max_tokens=120) for t in e.tokens]
    assert tokens == reference


def test_lookup_alone_accepts_what_its_proposals_predict():
    """The real index on a target that repeats itself now and then: each cycle accepts exactly
    what a brute-force search of the committed tokens proposes and the target agrees with."""
    model = build("qwen2", seed=2)
    prompt = [int(t) for t in np.random.default_rng(0).integers(4, VOCAB, 30)]
    reference = greedy_reference(model, prompt, 200)
    tokens, stats = decode(model, prompt, 200, PromptLookup(), policy=FixedBlockSize(4))
    assert tokens == reference
    sequence, position, expected = prompt + reference, len(prompt) + 1, []  # the prefill commits one
    while position < len(sequence):
        proposal = brute_force(sequence[:position], min(3, len(sequence) - position - 1))
        matched = next((i for i, t in enumerate(proposal) if t != sequence[position + i]), len(proposal))
        expected.append(matched + 1)
        position += matched + 1
    assert stats.acceptance_lengths == expected
    assert stats.accepted_by_source[LOOKUP] == sum(expected) - len(expected) > 5


def test_rollback_of_a_chat_reply_keeps_the_index_exact(monkeypatch):
    """Truncating a session (a chat drops a reply, the server rolls a cached prompt back)
    unindexes what it drops: the next generation proposes from what is left only."""
    model = build("llama", seed=1)
    prompt = [(5 * i + 1) % VOCAB for i in range(20)]
    session = DecodingSession(TargetModel(model), lookup=PromptLookup())
    first = [t for e in stream_session(
        session, prompt, GREEDY, max_tokens=30, stop=set(), detokenizer=FakeTokenizer().detokenizer,
        policy=FixedBlockSize(4)) for t in e.tokens]
    session.truncate(len(prompt))
    fresh = PromptLookup()
    fresh.sync(session.tokens)
    assert session.lookup._ends == fresh._ends
    second = [t for e in stream_session(
        session, [9, 9, 9], GREEDY, max_tokens=30, stop=set(), detokenizer=FakeTokenizer().detokenizer,
        policy=FixedBlockSize(4)) for t in e.tokens]
    assert second == greedy_reference(model, prompt + [9, 9, 9], 30)
    assert first == greedy_reference(model, prompt, 30)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3_text"])
def test_sampled_tokens_with_lookup_follow_the_target(model_type):
    """Sample-and-match with the lookup's proposals: every token is an exact sample of the target."""
    model = build(model_type, seed=3)
    prompt = [5, 17, 33, 90, 41, 12, 7, 64, 100, 23, 51]
    options = dict(temp=0.8, top_k=3)
    mx.random.seed(11)
    outputs, accepted = [], 0
    for _ in range(50):
        tokens, stats = decode(model, prompt, 24, GreedyLookup(model), sampler=make_sampler(**options))
        outputs.append(tokens)
        accepted += stats.accepted_by_source.get(LOOKUP, 0)
    assert accepted > 50
    p = pit_pvalue(model, [prompt] * len(outputs), outputs, seed=1, **options)
    assert p > P_HONEST, p
    assert pit_pvalue(model, [prompt] * len(outputs), outputs, seed=1, temp=options["temp"]) < P_BROKEN


def test_prefill_chunks_do_not_change_lookup(monkeypatch):
    model = build("qwen3", seed=2)
    prompt = [int(t) for t in np.random.default_rng(1).integers(4, VOCAB, 40)] * 2
    whole = decode(model, prompt, 40, PromptLookup())
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 7)
    chunked = decode(model, prompt, 40, PromptLookup())
    assert whole[0] == chunked[0] == greedy_reference(model, prompt, 40)
    assert whole[1].block_sizes == chunked[1].block_sizes


def test_the_server_prompt_cache_copies_and_rolls_back_the_index():
    """A cached session a new prompt diverges from is copied and the copy rolled back: both
    indexes stay those of their own tokens; decoding from the copy equals the target alone."""
    from mlx_dflash.server.worker.prompt_cache import PromptCache

    model = build("qwen3", seed=4)
    target = TargetModel(model)
    cache = PromptCache(1 << 30, lambda: DecodingSession(target, lookup=PromptLookup()))
    first = [(3 * i + 1) % VOCAB for i in range(24)] * 2
    session, _ = cache.fetch(first)
    list(stream_session(session, first, GREEDY, max_tokens=12, stop=set(), detokenizer=FakeTokenizer().detokenizer,
                        policy=FixedBlockSize(4)))
    cache.store(session)
    kept = list(session.tokens)
    second = first[:30] + [7, 8, 9]
    taken, reused = cache.fetch(second)
    assert taken is not session and reused == 30
    for s in (session, taken):
        fresh = PromptLookup()
        fresh.sync(s.tokens)
        s.lookup.sync(s.tokens)  # (the index catches up lazily, when asked to propose)
        assert s.lookup._ends == fresh._ends
    assert session.tokens == kept
    out = [t for e in stream_session(taken, second[len(taken.tokens):], GREEDY, max_tokens=20, stop=set(),
                                     detokenizer=FakeTokenizer().detokenizer, policy=FixedBlockSize(4))
           for t in e.tokens]
    assert out == greedy_reference(model, second, 20)


def test_stats_say_which_source_proposed_each_accepted_token():
    model = build("qwen3", seed=1)
    prompt = [(13 * i + 5) % VOCAB for i in range(12)]
    reference = greedy_reference(model, prompt, 30)
    drafter = ScriptedProposer(prompt + reference + [0] * 16, VOCAB, error_rate=0.3, seed=5, target_layer_ids=[0])
    lookup = OracleLookup(prompt + reference + [0] * 16, 0.2, 1, miss=0.5)
    session = DecodingSession(TargetModel(model), drafter, lookup=lookup)
    events = list(stream_session(session, prompt, GREEDY, max_tokens=30, stop=set(),
                                 detokenizer=FakeTokenizer().detokenizer, policy=AutoBlockSize(8, lookup=True)))
    stats = events[-1].stats
    by_event: dict[str, int] = {}
    for e in events:
        if e.num_draft_accepted:
            by_event[e.source] = by_event.get(e.source, 0) + e.num_draft_accepted
    assert by_event == {k: v for k, v in stats.accepted_by_source.items() if v}
    assert set(by_event) == {DFLASH, LOOKUP}
    for source, n in stats.accepted_by_source.items():
        assert n <= stats.proposed_by_source[source]


def test_a_seeded_sample_repeats_with_lookup_on():
    """A seed fixes the verify widths (no timing-driven choice), so it repeats the sample."""
    model = build("qwen3", seed=1)
    drafter = tiny_drafter(model, block_size=8)
    prompt = [(5 * i + 2) % VOCAB for i in range(16)] * 2
    for draft in (None, drafter):
        runs = [[t for e in mlx_dflash.stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt,
                                                       draft_model=draft, temp=1.0, seed=3, max_tokens=30)
                 for t in e.tokens] for _ in range(2)]
        assert runs[0] == runs[1]


def simulate(p_drafter: float, p_lookup: float, match_rate: float, cycles: int = 400, seed: int = 0) -> dict:
    """`auto` with both sources in a Mac-like regime (a draft pass 0.3 plain steps, a verify of L
    tokens 1 + 0.015 L): per-position acceptance p for each source, a lookup match at
    `match_rate` of the cycles. Returns the chosen sources' cycle counts and tokens per second."""
    rng = np.random.default_rng(seed)
    verify = lambda L: 1.0 + 0.015 * L  # noqa: E731
    policy = AutoBlockSize(16, lookup=True)
    policy.begin()
    chosen, tokens, seconds = {DFLASH: 0, LOOKUP: 0, None: 0}, 0, 0.0
    for _ in range(cycles):
        offers = {DFLASH: 15, **({LOOKUP: 15} if rng.random() < match_rate else {})}
        size = policy.choose(10**6, 100, offers)
        source = policy.source if size > 1 else None
        p = p_lookup if source == LOOKUP else p_drafter
        accepted = int(np.argmin(np.append(rng.random(size - 1) < p, False))) if size > 1 else 0
        cost = 0.01 * (verify(size) + (0.3 if source == DFLASH else 0.0)) if size > 1 else 0.01
        policy.record(size, accepted, cost)
        if LOOKUP in offers and source != LOOKUP:  # what the lookup's proposal would have had accepted
            seen = accepted + 1
            policy.shadow(LOOKUP, seen, int(np.argmin(np.append(rng.random(seen) < p_lookup, False))))
        chosen[source] += 1
        tokens, seconds = tokens + accepted + 1, seconds + cost
    return {"chosen": chosen, "tps": tokens / seconds}


def test_auto_keeps_a_strong_drafter_and_takes_a_lookup_that_copies():
    strong = simulate(p_drafter=0.95, p_lookup=0.3, match_rate=0.6)
    assert strong["chosen"][DFLASH] >= 0.97 * 400  # a poor lookup does not displace a strong drafter
    copying = simulate(p_drafter=0.3, p_lookup=0.97, match_rate=0.6)
    assert copying["chosen"][LOOKUP] >= 0.9 * 0.6 * 400  # nearly every match of a copying lookup is verified
    weak = simulate(p_drafter=0.95, p_lookup=0.0, match_rate=1.0)
    assert weak["chosen"][LOOKUP] <= 4  # a lookup that is never right is (nearly) never verified


@pytest.mark.parametrize("alphabet", [20, 2000, 50000])  # repetitive, text-like, all n-grams new
def test_the_index_memory_estimate_follows_what_python_allocates(alphabet):
    import tracemalloc

    tokens = [int(t) for t in np.random.default_rng(alphabet).integers(0, alphabet, 6000)]
    lookup = PromptLookup()
    tracemalloc.start()
    try:
        lookup.sync(tokens)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.75 * used <= lookup.nbytes <= 1.33 * used
    lookup.truncate(tokens, 100)
    small = PromptLookup()
    small.sync(tokens[:100])
    assert lookup.nbytes == small.nbytes and lookup.copy().nbytes == small.nbytes


def test_a_stored_session_counts_its_lookup_index():
    from mlx_dflash.server.worker.prompt_cache import session_bytes

    model = build("qwen3", seed=0)
    session = DecodingSession(TargetModel(model), None, lookup=PromptLookup())
    tokens = [int(t) for t in np.random.default_rng(1).integers(4, VOCAB, 300)]
    session.extend(tokens, make_sampler(0.0))
    session.lookup.sync(session.tokens)
    without = sum(c.nbytes for c in session.cache)
    assert session.lookup.nbytes > 0 and session_bytes(session) == without + session.lookup.nbytes
