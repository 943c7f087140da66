"""Every supported target family: exact capture forward, lossless decoding, exact rollback.

Hybrid (Qwen3.5/3.6, Qwen3-Next: GatedDeltaNet state in ArraysCache) and
sliding-window (gpt-oss, Gemma 3/4: RotatingKVCache) targets cannot trim their
caches; these tests hold the checkpoint-and-replay rollback to the target alone.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.families import HYBRID_CONFIGS, assert_same_state, build, decode
from helpers.tiny import (
    FAMILY_CONFIGS,
    VOCAB,
    FakeTokenizer,
    ScriptedProposer,
    greedy_reference,
    tiny_drafter,
)
from mlx_lm.models.cache import ArraysCache

import mlx_dflash
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.generate import make_sampler
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel, supported_model_types


@pytest.fixture(scope="module")
def targets():
    return {t: build(t, seed=1) for t in HYBRID_CONFIGS}


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_every_supported_family_is_tested():
    assert set(supported_model_types()) == set(FAMILY_CONFIGS) | set(HYBRID_CONFIGS)


@pytest.mark.parametrize("model_type", sorted(set(FAMILY_CONFIGS) | set(HYBRID_CONFIGS)))
def test_capture_forward_reproduces_model_call(model_type):
    model = build(model_type)
    x = mx.array([[5, 9, 33, 17, 60, 2, 7, 8, 9, 10, 11, 12, 40, 41]])
    target = TargetModel(model)
    hidden, features = target.forward(x, target.make_cache(), [0, 2])
    assert mx.array_equal(target.logits(hidden), model(x)).item()
    assert features.shape == (1, x.shape[1], 2 * target.hidden_size)


CASES = [  # (prompt length, block size, max tokens, proposer error rate, seed)
    (1, 4, 21, 0.0, 0), (5, 16, 40, 0.3, 1), (13, 7, 45, 0.5, 2), (30, 3, 33, 1.0, 3),
    (9, 9, 50, 0.2, 4), (2, 2, 17, 0.6, 5),
]


@pytest.mark.parametrize("model_type", sorted(HYBRID_CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "p{}-b{}-n{}-e{}-s{}".format(*c))
def test_greedy_lossless(targets, model_type, case):
    prompt_len, block, max_tokens, error_rate, seed = case
    model = targets[model_type]
    prompt = [(11 * i + 7 * seed + 5) % VOCAB for i in range(prompt_len)]
    ref = greedy_reference(model, prompt, max_tokens)
    proposer = ScriptedProposer(prompt + ref, VOCAB, error_rate, seed=seed, target_layer_ids=[1, 2])
    events = list(mlx_dflash.stream_generate(
        model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=proposer, max_tokens=max_tokens, block_size=block))
    assert tokens_of(events) == ref
    lengths = events[-1].stats.acceptance_lengths
    if error_rate == 0.0:
        assert max(lengths) == block  # full blocks were accepted (and rolled forward)
    if error_rate == 1.0:
        assert set(lengths) == {1}


@pytest.mark.parametrize("model_type", sorted(HYBRID_CONFIGS))
def test_greedy_lossless_with_dflash_drafter(targets, model_type):
    model = targets[model_type]
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    prompt = list(range(20, 40))
    ref = greedy_reference(model, prompt, 30)
    out = tokens_of(mlx_dflash.stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=drafter,
                                               max_tokens=30))
    assert out == ref


def _state_arrays(cache) -> list[mx.array]:
    return [a for c in cache if isinstance(c, ArraysCache) for a in c.cache]


@pytest.mark.parametrize("model_type", sorted(HYBRID_CONFIGS))
def test_rollback_leaves_exactly_the_committed_state(targets, model_type):
    """After every cycle the caches equal those of a target fed only the committed tokens."""
    model = targets[model_type]
    target = TargetModel(model)
    prompt = [3, 50, 7, 90, 12, 44]
    ref = greedy_reference(model, prompt, 40)
    proposer = ScriptedProposer(prompt + ref, VOCAB, 0.4, seed=7, target_layer_ids=[1])
    session = DecodingSession(target, proposer)
    greedy = make_sampler(0.0)
    session.extend(prompt, greedy)
    probe = mx.array([[17]])
    for _ in range(6):
        verified = session.step(greedy, 8)
        session.keep(verified, len(verified.tokens))
        fresh = target.make_cache()
        committed = mx.array(session.tokens[:-1], dtype=mx.uint32)[None]
        target.forward(committed, fresh)
        for ours, theirs in zip(_state_arrays(session.cache), _state_arrays(fresh), strict=True):
            assert mx.allclose(ours, theirs, atol=1e-4, rtol=1e-4).item()
        # Attention and sliding-window caches: the next forward must see the same context.
        saved = target.checkpoint(session.cache)
        ours = target.logits(target.forward(probe, session.cache)[0])
        target.rollback(session.cache, 1, saved)  # undo the probe
        theirs = target.logits(target.forward(probe, fresh)[0])
        assert mx.allclose(ours, theirs, atol=1e-4, rtol=1e-4).item()


def test_broken_rollback_is_caught(targets, monkeypatch):
    """Control: a rollback that forgets the recurrent state diverges from the target alone."""
    model = targets["qwen3_5"]

    def trim_only(self, cache, num_tokens, checkpoint=None, replay=None):
        for c in cache:
            if not isinstance(c, ArraysCache):
                c.trim(num_tokens)

    monkeypatch.setattr(TargetModel, "rollback", trim_only)
    prompt = list(range(30, 45))
    ref = greedy_reference(model, prompt, 40)
    proposer = ScriptedProposer(prompt + ref, VOCAB, 0.5, seed=3, target_layer_ids=[1])
    out = tokens_of(mlx_dflash.stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=proposer,
                                               max_tokens=40, block_size=8))
    assert out != ref


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma3_text"])
def test_truncate_recomputes_recurrent_state(targets, model_type):
    """Chat drops a reply: a hybrid or sliding-window session rewinds by recomputing, state and all."""
    model = targets[model_type]
    target = TargetModel(model)
    drafter = tiny_drafter(model, block_size=6, target_layer_ids=[0, 3])
    greedy = make_sampler(0.0)

    def new_session():
        return DecodingSession(target, DFlashProposer(drafter, target, max_block_size=6))

    session = new_session()
    prompt = [5, 6, 7, 8, 30, 31, 32, 33, 34, 35]
    session.extend(prompt, greedy)
    decode(session, greedy, 12, 6)
    keep = len(prompt) + 4
    session.truncate(keep)
    fresh = new_session()
    fresh.extend(session.tokens[:-1], greedy)
    assert_same_state(session, fresh)  # caches, recurrent states and draft context, not only tokens
    session.extend([9, 10], greedy)
    fresh.extend([9, 10], greedy)
    history = session.tokens[:-1]
    assert decode(session, greedy, 20, 6) == decode(fresh, greedy, 20, 6) == greedy_reference(model, history, 21)[1:]


def test_a_layer_captured_twice_fills_both_slots():
    """The reference layer rule gives [1, 1] for 4 target layers and 2 draft layers."""
    target = TargetModel(build("qwen3"))
    x = mx.array([[5, 9, 33]])
    _, twice = target.forward(x, target.make_cache(), [1, 1])
    _, once = target.forward(x, target.make_cache(), [1])
    assert mx.array_equal(twice, mx.concatenate([once, once], axis=-1)).item()
