"""SessionBatch: several sessions decoded in one draft forward and one verify forward per cycle.

Every batched reply must equal the same request decoded alone (mlx-lm's own greedy
decoding of the target), in every family a batch takes, with rows of different prompt
lengths and budgets, stop tokens inside blocks, rows joining and leaving mid-run. A batched
forward may round differently from a lone one (float32 on the CPU: ~1e-5, see
test_ragged_cache): a failure reports the reference's top-2 margin at the first differing
token, and `test_fixture_margins_exceed_the_batched_rounding` shows the fixtures' margins
are far above that gap, so equality here is not luck.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.families import FAMILIES
from helpers.tiny import VOCAB, FakeTokenizer, greedy_reference

from mlx_dflash.auto.policy import AUTO, make_policy
from mlx_dflash.batching.batch import SessionBatch, refusal
from mlx_dflash.batching.draft_cache import RaggedDraftCache
from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.errors import DFlashError
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.targets.model import TargetModel

BATCHED_GAP = 1e-4  # the largest batched-vs-alone logit gap test_ragged_cache allows


def margins(model, prompt: list[int], reply: list[int]) -> list[float]:
    """Top-1 minus top-2 logit of the target alone at every reply position."""
    logits = model(mx.array(prompt + reply, dtype=mx.uint32)[None])[0, len(prompt) - 1 : -1]
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).tolist()


def explain(model, prompt, reply, reference) -> str:
    first = next((i for i, (a, b) in enumerate(zip(reply, reference, strict=False)) if a != b), None)
    if first is None:
        return f"lengths differ: {len(reply)} vs {len(reference)}"
    margin = margins(model, prompt, reference)[first]
    return f"first difference at token {first}, reference top-2 margin there {margin:.3g}"


class Member:
    """One request in a batch test: its session and stream, driven as the server drives them."""

    def __init__(self, target, drafter, prompt, max_tokens, stop=(), block=8, sampler=None, policy=None):
        self.prompt, self.max_tokens, self.stop = prompt, max_tokens, set(stop)
        self.sampler = sampler or make_sampler(0.0)
        self.session = DecodingSession(target, make_proposer(target, drafter, block) if drafter else None)
        self.stream = stream_session(self.session, prompt, self.sampler, max_tokens=max_tokens, stop=self.stop,
                                     detokenizer=FakeTokenizer(eos_token_ids=()).detokenizer,
                                     policy=policy or FixedBlockSize(block))
        self.tokens: list[int] = []
        self.done = False

    def pull(self) -> None:
        event = next(self.stream)
        self.tokens.extend(event.tokens)
        self.done = event.finish_reason is not None
        self.num_tokens = event.stats.num_tokens

    def join(self, batch: SessionBatch) -> None:
        batch.add(self.session, self.sampler, self.stop, self.max_tokens - self.num_tokens)


def run_batch(batch: SessionBatch, members: list[Member], joins: dict[int, int] | None = None,
              leaves: dict[int, int] | None = None) -> None:
    """Prefill every member, batch them (member i joins after `joins[i]` cycles; leaves to go on alone
    after `leaves[i]`), and cycle until all are done."""
    joins, leaves = joins or {}, leaves or {}
    for m in members:
        m.pull()
    cycle = 0
    while not all(m.done for m in members):
        for i, m in enumerate(members):
            if not m.done and m.session.batch is None and joins.get(i, 0) <= cycle and leaves.get(i, 1 << 30) > cycle:
                m.join(batch)
        if len(batch):
            batch.step()
        for i, m in enumerate(members):
            if m.done:
                continue
            m.pull()
            if m.session.batch is not None and (m.done or leaves.get(i, 1 << 30) <= cycle + 1):
                batch.remove(m.session)
        cycle += 1


def prompts_for(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, VOCAB, n)] for n in lengths]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_greedy_replies_equal_each_alone(family, targets, drafters):
    model, drafter = targets(family), drafters(family)
    target = TargetModel(model)
    assert refusal(DecodingSession(target, make_proposer(target, drafter, 8))) is None
    prompts = prompts_for(FAMILIES[family], (1, 37, 9, 120, 64))
    budgets = [23, 7, 31, 16, 40]
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, budgets, strict=True)]
    # A stop token inside a later block of member 2: its reply ends there, the others go on.
    stops = [(), (), (references[2][12],), (), ()]
    members = [Member(target, drafter, p, n, s) for p, n, s in zip(prompts, budgets, stops, strict=True)]
    batch = SessionBatch(target, FixedBlockSize(8))
    run_batch(batch, members, joins={3: 4}, leaves={4: 6})
    for m, ref in zip(members, references, strict=True):
        expected = ref[: ref.index(next(iter(m.stop)))] if m.stop else ref
        assert m.tokens == expected, explain(model, m.prompt, m.tokens, expected)
    assert sum(batch.widths.values()) > 0 and not len(batch)


def test_auto_width_and_plain_steps_stay_exact(targets, drafters):
    model, drafter = targets("qwen3"), drafters("qwen3")
    target = TargetModel(model)
    prompts = prompts_for(7, (12, 50, 3))
    members = [Member(target, drafter, p, 20) for p in prompts]
    batch = SessionBatch(target, make_policy(AUTO, 8))
    run_batch(batch, members)
    assert len(batch.widths) >= 2  # the width policy measured more than one width
    for m in members:
        assert m.tokens == greedy_reference(model, m.prompt, 20)
    # No drafter: plain batched steps.
    members = [Member(target, None, p, 15, block=1) for p in prompts]
    batch = SessionBatch(target, FixedBlockSize(1))
    run_batch(batch, members)
    assert batch.widths == {1: 14}
    for m in members:
        assert m.tokens == greedy_reference(model, m.prompt, 15)


def test_batched_drafts_equal_each_drafted_alone(targets, drafters):
    """The batched draft cache holds each row's context as its own cache would (after commits of
    different lengths), so one drafter forward drafts what each row's proposer drafts alone."""
    model, drafter = targets("llama"), drafters("llama")
    target = TargetModel(model)
    members = [Member(target, drafter, p, 40) for p in prompts_for(3, (5, 33, 70))]
    alone = [Member(target, drafter, m.prompt, 40) for m in members]
    batch = SessionBatch(target, FixedBlockSize(8))
    for m, solo in zip(members, alone, strict=True):
        m.pull()
        solo.pull()
        m.join(batch)
    for _ in range(4):
        batch.step()
        for m, solo in zip(members, alone, strict=True):
            m.pull()
            solo.pull()
    positions = mx.array([m.session.position for m in members], dtype=mx.int32)
    assert batch.draft.lengths == positions.tolist()
    pending = mx.array([[m.session.tokens[-1]] for m in members], dtype=mx.uint32)
    block = mx.concatenate([pending, mx.full((3, 7), drafter.mask_token_id, dtype=mx.uint32)], axis=1)
    batched = drafter(target.embed(block), batch.draft, positions)
    for i, solo in enumerate(alone):
        solo.session.inject_pending()
        own = drafter(target.embed(block[i : i + 1]), solo.session.proposer.cache, solo.session.position)
        assert mx.abs(batched[i : i + 1] - own).max().item() < 1e-4
        assert mx.array_equal(mx.argmax(batched[i], -1), mx.argmax(own[0], -1)).item()
        # A row handed back is the lone cache, position for position.
        back = batch.draft.row(i)
        n = back.stored
        assert n == solo.session.proposer.cache.stored
        assert mx.abs(back.keys[0][..., :n, :] - solo.session.proposer.cache.keys[0][..., :n, :]).max().item() < 1e-4


def test_a_sampled_row_draws_what_it_draws_alone(targets, drafters):
    """A sampled row's tokens come from its own row of the target's distribution, with its own sampler:
    seeded the same, with greedy rows beside it (they draw nothing), it samples exactly what it samples alone."""
    model, drafter = targets("qwen3"), drafters("qwen3")
    target = TargetModel(model)
    prompt, others = prompts_for(11, (20,))[0], prompts_for(12, (8, 30))
    sampler = make_sampler(0.8, top_p=0.9)
    mx.random.seed(5)
    alone = Member(target, drafter, prompt, 30, sampler=sampler)
    while not alone.done:
        alone.pull()
    mx.random.seed(5)
    members = [Member(target, drafter, prompt, 30, sampler=sampler)] + [Member(target, drafter, p, 30) for p in others]
    run_batch(SessionBatch(target, FixedBlockSize(8)), members)
    assert members[0].tokens == alone.tokens
    for m in members[1:]:
        assert m.tokens == greedy_reference(model, m.prompt, 30)


def test_fixture_margins_exceed_the_batched_rounding(targets):
    """Where a reply's top-2 margin is below the batched rounding gap, a flip would be possible:
    the fixtures above have none, by a wide factor."""
    for family in FAMILIES:
        model = targets(family)
        for p, n in zip(prompts_for(FAMILIES[family], (1, 37, 9, 120, 64)), (23, 7, 31, 16, 40), strict=True):
            smallest = min(margins(model, p, greedy_reference(model, p, n)))
            assert smallest > 10 * BATCHED_GAP, (family, smallest)


def test_what_cannot_be_batched_is_refused_with_its_reason(targets, drafters):
    """Refusals of the pair (the server then decodes its requests side by side: test_server_batch)."""
    from helpers.tiny_dflash2 import tiny_dflash2

    target = TargetModel(targets("qwen3"))
    session = DecodingSession(target, make_proposer(target, drafters("qwen3"), 8, draft_window=64))
    assert "sliding window of context" in refusal(session)
    with pytest.raises(DFlashError, match="cannot be batched"):
        SessionBatch(target, FixedBlockSize(8)).add(session, make_sampler(0.0), set(), 10)
    with pytest.raises(DFlashError, match="window"):
        RaggedDraftCache.from_caches([session.proposer.cache])
    dflash2 = DecodingSession(target, make_proposer(target, tiny_dflash2(targets("qwen3"))[0], 8))
    assert "DFlash2Proposer proposer drafts one sequence at a time" in refusal(dflash2)
    for family, reason in (("gemma3_text", "sliding-window attention layers"), ("qwen3_next", "recurrent layers")):
        from helpers.families import build

        assert reason in refusal(DecodingSession(TargetModel(build(family)), None))


def test_draft_rows_move_in_and_out_unchanged():
    """Rows joined one by one (`extend`), some dropped (`filter`), handed back (`row`): each the cache it came from."""
    from mlx_dflash.drafters.draft_cache import DraftContextCache

    rng = np.random.default_rng(0)
    caches = []
    for n in (3, 300, 0, 41):
        cache = DraftContextCache(2, 2, 8, max_block_size=8)
        if n:
            cache.append([mx.array(rng.normal(size=(1, 2, n, 8)), dtype=mx.float32) for _ in range(2)],
                         [mx.array(rng.normal(size=(1, 2, n, 8)), dtype=mx.float32) for _ in range(2)])
        caches.append(cache)
    batch = RaggedDraftCache.from_caches(caches[:1])
    for cache in caches[1:]:
        batch.extend(RaggedDraftCache.from_caches([cache]))
    batch.filter([3, 1, 2])
    assert batch.lengths == [41, 300, 0]
    for i, source in enumerate(caches[j] for j in (3, 1, 2)):
        back, n = batch.row(i), source.stored
        assert back.stored == n and back.capacity >= n + 8
        if n == 0:  # never written: the source has no buffers yet
            continue
        for ours, theirs in zip(back.keys + back.values, source.keys + source.values, strict=True):
            assert mx.array_equal(ours[..., :n, :], theirs[..., :n, :]).item()
