"""Marks: a session of an unrewindable target (recurrent, rotating) goes back to a marked length
exactly as if it had been fed only that prefix, and the marks stay few."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.families import HYBRID_CONFIGS, build, cached_drafter, cached_target, decode
from helpers.tiny import tiny_drafter
from mlx.utils import tree_flatten

from mlx_dflash.decoding.prefix_marks import MAX_MARKS, PrefixMark, mark_positions, thin
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel

GREEDY = make_sampler(0.0)
OPENER = 7
PROMPT = [1, 5, 9, OPENER, 4, 4, 8, 2, 6, OPENER, 3, 9, 9, 5, 11, 12, OPENER, 10, 2, 1]


def hybrid_session(model_type: str, drafter: bool = True) -> DecodingSession:
    target = TargetModel(build(model_type))
    proposer = DFlashProposer(tiny_drafter(target.model), target, max_block_size=8) if drafter else None
    return DecodingSession(target, proposer)


def assert_same_caches(session: DecodingSession, fresh: DecodingSession) -> None:
    """Equal committed state: recurrent and rotating states whole, K/V up to the offset, the draft context."""
    assert session.tokens == fresh.tokens
    for ours, theirs in zip(session.cache, fresh.cache, strict=True):
        assert type(ours) is type(theirs) and getattr(ours, "offset", None) == getattr(theirs, "offset", None)
        if hasattr(ours, "max_size"):
            continue  # a rotating buffer's layout depends on how it was fed: compared by what follows
        end = getattr(ours, "offset", None) if hasattr(ours, "trim") and ours.is_trimmable() else None
        for (_, x), (_, y) in zip(tree_flatten(ours.state), tree_flatten(theirs.state), strict=True):
            if isinstance(x, mx.array):
                if end is not None and x.ndim == 4:
                    x, y = x[..., :end, :], y[..., :end, :]
                # float32 computed over prefixes of different lengths: BLAS blocks them differently per CPU
                assert x.shape == y.shape and mx.allclose(x, y, rtol=1e-4, atol=1e-5).item(), \
                    float(mx.abs(x - y).max())
            else:
                assert x == y
    draft, other = session.proposer.cache, fresh.proposer.cache
    session.inject_pending()
    fresh.inject_pending()
    assert draft.offset == other.offset
    for a, b in zip(draft.state_arrays(), other.state_arrays(), strict=True):
        assert mx.allclose(a[..., : draft.stored, :], b[..., : other.stored, :], atol=1e-5).item()


def test_mark_positions_before_openers_and_every_stretch():
    assert mark_positions(PROMPT, 1, {OPENER}, every=0) == [3, 9, 16]
    assert mark_positions(PROMPT, 5, {OPENER}, every=0) == [9, 16]
    assert mark_positions(list(range(100, 130)), 1, set(), every=10) == [11, 21]
    assert mark_positions(PROMPT, 1, set(), every=0) == []


def test_thin_keeps_the_first_and_the_latest():
    marks = [PrefixMark(n, {}) for n in range(2, 2 + 3 * MAX_MARKS)]
    kept = [m.length for m in thin(marks)]
    assert len(kept) == MAX_MARKS and kept[:2] == [2, 3] and kept[-1] == marks[-1].length


@pytest.mark.parametrize("model_type", ["qwen3_5", "gpt_oss", "gemma3_text"])
def test_truncate_to_a_mark_equals_a_session_fed_that_prefix(model_type):
    session = hybrid_session(model_type)
    assert not session.rewindable
    session.prefill_chunk = 4  # marks cut chunks: 3 and 9 are not multiples of 4
    session.mark_at = set(mark_positions(PROMPT, 0, {OPENER}, every=0))
    session.extend(PROMPT, GREEDY)
    decode(session, GREEDY, 6, 4)
    assert [m.length for m in session.marks] == [4, 10, 17]
    fed = len(session.tokens)
    session.truncate(10)  # back to the mark before the second opener: nothing recomputed
    assert len(session.tokens) == 10 and [m.length for m in session.marks] == [4, 10]
    fresh = DecodingSession(session.target, DFlashProposer(session.proposer.drafter, session.target, max_block_size=8))
    fresh.extend(PROMPT[:9], GREEDY)
    fresh.tokens[-1] = PROMPT[9]
    assert_same_caches(session, fresh)
    # And it goes on as a session that never held the rest: greedy tokens equal.
    session.extend(PROMPT[10:], GREEDY)
    fresh.extend(PROMPT[10:], GREEDY)
    assert mx.allclose(session.prefill_logprobs, fresh.prefill_logprobs, atol=1e-4).item()
    assert decode(session, GREEDY, 8, 4) == decode(fresh, GREEDY, 8, 4)
    assert fed > 10


def test_truncate_without_a_mark_still_recomputes():
    session = hybrid_session("qwen3_5", drafter=False)
    session.extend(PROMPT, GREEDY)
    before = session.cache
    session.truncate(8)
    assert session.cache is not before and len(session.tokens) == 8  # recomputed from scratch, as before


def test_rewindable_targets_keep_no_marks():
    target = TargetModel(cached_target("qwen3"))
    session = DecodingSession(target, DFlashProposer(cached_drafter("qwen3"), target, max_block_size=8))
    session.mark_at = {3, 9}
    session.extend(PROMPT, GREEDY)
    assert session.rewindable and session.marks == []


def test_hybrid_configs_cover_recurrent_and_rotating():
    assert {"qwen3_5", "gpt_oss", "gemma3_text"} <= set(HYBRID_CONFIGS)


def test_stride_marks_start_at_the_first_message_boundary():
    prompt = [5] * 30 + [OPENER] + [6] * 30
    assert mark_positions(prompt, 0, {OPENER}, every=10) == [30, 40, 50, 60]
    assert mark_positions([5] * 30, 0, {OPENER}, every=10) == [10, 20]  # no opener: stride from the start


def test_a_long_system_prompts_end_stays_marked_however_long_the_conversation():
    """The mark a new session with the same system prompt needs (its end) is never thinned away, even
    when the system prompt is long enough for stride marks and many turns follow."""
    session = hybrid_session("qwen3_5", drafter=False)
    system = [1] + [5, 9, 4] * 10  # 31 tokens without an opener: stride marks would fall inside
    full = list(system)
    for turn in range(MAX_MARKS + 2):
        full += [OPENER, 8, 2 + turn % 5, 6, OPENER, 3]
        start = len(session.tokens)
        session.mark_at = set(mark_positions(full, start, {OPENER}, every=10))
        session.extend(full[start:], GREEDY)
        full = list(session.tokens)
    lengths = [m.length for m in session.marks]
    assert len(lengths) == MAX_MARKS and lengths[0] == len(system) + 1  # cache held the system prompt
