"""A float16 drafter whose feature projection overflows falls back to float32 features.

Targets' hidden states reach tens of thousands in a few channels, and float16 ends at 65504:
the drafter's projection of the concatenated features overflows, the context K/V become
NaN, and every draft is garbage (rival ports' users see zero acceptance on M1/M2). The
proposer reads each draft's finiteness with its verify; the first non-finite draft switches
the injector to a float32 projection, with one warning, and re-injects the features since
the last finite draft. Output is the target's throughout: only drafts were ever wrong.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import FakeTokenizer, greedy_reference, tiny_drafter, tiny_target

from mlx_dflash import stream_generate
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.targets.model import TargetModel

MAGNITUDE = 60_000.0  # representable in float16; sums of a few such products are not
PROMPT = [5, 17, 42, 9, 77, 31, 8, 64, 12, 90, 33, 21, 6, 44]


class LoudTarget(TargetModel):
    """A target whose captured features peak at MAGNITUDE in every row (massive activations)."""

    def forward(self, tokens, cache, capture=(), checkpoint=None):
        hidden, features = super().forward(tokens, cache, capture, checkpoint)
        if features is not None:
            peak = mx.abs(features.astype(mx.float32)).max(axis=-1, keepdims=True)
            features = (features.astype(mx.float32) / peak * MAGNITUDE).astype(features.dtype)
        return hidden, features


def half_pair(dtype=mx.float16):
    model = tiny_target("qwen3", seed=0)
    drafter = tiny_drafter(model, seed=1, block_size=8)
    model.set_dtype(dtype)
    drafter.set_dtype(dtype)
    return model, drafter


def loud_features(n: int, width: int, dtype=mx.float16) -> mx.array:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.0, 1.0, (1, n, width))
    x[..., 0] = 1.0  # one channel at the full magnitude in every row
    return mx.array(MAGNITUDE * x, dtype=mx.float32).astype(dtype)


def test_features_of_60000_overflow_float16_and_float32_features_fix_it(caplog):
    model, drafter = half_pair()
    target = TargetModel(model)
    proposer = DFlashProposer(drafter, target, max_block_size=8)
    assert proposer.guarded
    width = len(drafter.target_layer_ids) * target.hidden_size
    features = loud_features(9, width)
    assert bool(mx.isfinite(features).all())
    proposer.commit(features[:, :6], 0)
    proposer.commit(features[:, 6:], 6)
    last = mx.array([40], dtype=mx.uint32)
    proposer.propose(last, 9, 8)
    assert not proposer.last_draft_finite.item()  # the overflow is real

    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        proposer.checked(False)
    assert proposer.injector.wide and proposer.cache.offset == 9
    draft = proposer.propose(last, 9, 8)
    assert proposer.last_draft_finite.item()
    proposer.checked(True)
    [record] = caplog.records
    assert "float32" in record.getMessage()

    # The re-injected context is the one a float32 projection gives from the start.
    fresh = DFlashProposer(drafter, target, max_block_size=8)
    fresh.commit(features[:, :6], 0)  # in the same chunks: a matmul's rounding depends on its rows
    fresh.commit(features[:, 6:], 6)
    np.testing.assert_array_equal(np.array(fresh.propose(last, 9, 8)), np.array(draft))
    for got, want in zip(proposer.cache.state_arrays(), fresh.cache.state_arrays(), strict=True):
        np.testing.assert_array_equal(np.array(got[..., :9, :].astype(mx.float32)),
                                      np.array(want[..., :9, :].astype(mx.float32)))


def test_decoding_with_overflowing_features_stays_exact_and_recovers_once(caplog):
    model, drafter = half_pair()
    drafter._context_injector = None  # a fresh injector: not widened by another test
    target = LoudTarget(model)
    proposer = DFlashProposer(drafter, target, max_block_size=8)
    outcomes: list[bool] = []
    original = proposer.checked

    def record(finite: bool) -> None:
        outcomes.append(finite)
        original(finite)

    proposer.checked = record
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        tokens = []
        for event in stream_generate(target, FakeTokenizer(), PROMPT, draft_model=proposer, max_tokens=40,
                                     block_size=8, prompt_lookup=False):
            tokens.extend(event.tokens)
    assert tokens == greedy_reference(model, PROMPT, 40)  # the target's own output, in float16
    assert outcomes[0] is False and all(outcomes[1:]) and len(outcomes) > 2
    assert len(caplog.records) == 1


def test_bfloat16_and_float32_drafters_are_not_guarded():
    """bfloat16 has float32's range: nothing to guard, nothing kept, no extra sync."""
    for dtype in (mx.bfloat16, mx.float32):
        model, drafter = half_pair(dtype)
        proposer = DFlashProposer(drafter, TargetModel(model), max_block_size=8)
        proposer.commit(loud_features(4, len(drafter.target_layer_ids) * model.args.hidden_size, dtype), 0)
        proposer.propose(mx.array([40], dtype=mx.uint32), 4, 8)
        assert not proposer.guarded and proposer.last_draft_finite is None and not proposer._unconfirmed


def test_a_trimmed_or_copied_session_keeps_only_its_own_unconfirmed_features():
    model, drafter = half_pair()
    session = DecodingSession(TargetModel(model), DFlashProposer(drafter, TargetModel(model), max_block_size=8))
    session.extend(PROMPT, lambda logprobs: mx.argmax(logprobs, axis=-1))
    session.inject_pending()
    proposer = session.proposer
    assert sum(f.shape[1] for f, _ in proposer._unconfirmed) == len(PROMPT)
    proposer.trim(4)
    assert sum(f.shape[1] for f, _ in proposer._unconfirmed) == len(PROMPT) - 4 == proposer.cache.offset


@pytest.mark.parametrize("finite", [True, False])
def test_checked_forgets_only_what_the_draft_read(finite):
    model, drafter = half_pair()
    drafter._context_injector = None
    proposer = DFlashProposer(drafter, TargetModel(model), max_block_size=8)
    width = len(drafter.target_layer_ids) * model.args.hidden_size
    proposer.commit(loud_features(3, width) / 1000, 0)
    proposer.propose(mx.array([40], dtype=mx.uint32), 3, 8)
    proposer.commit(loud_features(2, width) / 1000, 3)  # after the draft: not confirmed by it
    proposer.checked(finite)
    kept = [p for _, p in proposer._unconfirmed]
    assert kept == ([3] if finite else [0, 3])
