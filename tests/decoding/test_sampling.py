"""Sampling (temperature > 0) is lossless: emitted tokens are exact samples of the target.

On a 16-token vocabulary the exact distribution of the first generated tokens
is enumerated in numpy from the target's logits for every prefix
(P(t1) = sum_t0 P(t0) P(t1 | t0), ...), with mlx-lm's `make_sampler` semantics:
top-p (and min-p, top-k) filter the temperature-1 log-probabilities, then the
kept logits are divided by the temperature and sampled. Thousands of DFlash
generations with a proposer that is often right (so drafts really are
accepted) must match it under a chi-square test; the same statistic rejects a
deliberately biased acceptance rule, so the test has teeth.
"""

from __future__ import annotations

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from helpers.distributions import P_HONEST, SEED, VOCAB, MemoOracle, N, exact_distributions, pvalues, sample_many
from helpers.tiny import tiny_target

from mlx_dflash import stream_generate

# The module, not the `generate` function that `mlx_dflash` re-exports under the same name.
generate_module = importlib.import_module("mlx_dflash.generate")

P_BIASED = 1e-6


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", seed=SEED, vocab=VOCAB, num_layers=2)  # 2 layers: faster sampling


N_BIASED = 1200


@pytest.mark.slow
@pytest.mark.parametrize(
    "temp, top_p, seed",
    [(1.0, 0.0, 11), (0.8, 0.8, 12)],
    ids=["temp1", "top_p0.8-temp0.8"],
)
def test_sampled_tokens_follow_the_target_distribution(model, make_tokenizer, temp, top_p, seed):
    exact = exact_distributions(model, temp, top_p)
    # The distributions at the positions drafts supply are far from one-hot: a real test.
    assert exact["t1"].max() < 0.8 and exact["t2"].max() < 0.8
    samples, accepted = sample_many(model, make_tokenizer(()), N, seed, temp=temp, top_p=top_p)
    # Drafts were really accepted: most tokens at position 1 came from the proposer.
    assert accepted > 0.25 * N, accepted
    p = pvalues(samples, exact)
    assert min(p.values()) > P_HONEST, p
    if top_p:
        # The other filtering order (temperature first) is a different distribution here,
        # and the samples tell them apart: the reference semantics matter.
        other = exact_distributions(model, temp, top_p, order="temperature-first")
        assert np.abs(other["t1"] - exact["t1"]).sum() > 0.02
        assert min(pvalues(samples, other).values()) < P_BIASED


@pytest.mark.slow
def test_biased_acceptance_is_detected(model, make_tokenizer, monkeypatch):
    """Accepting a draft whenever the target gives it >= 20% probability is not lossless."""
    real_make_sampler = generate_module.make_sampler
    proposers: list[MemoOracle] = []

    class TrackedOracle(MemoOracle):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            proposers.append(self)

    def biased_make_sampler(*args, **kwargs):
        sampler = real_make_sampler(*args, **kwargs)

        def biased(logprobs):
            tokens = sampler(logprobs)
            if logprobs.ndim == 2 and logprobs.shape[0] > 1:  # a verify pass
                draft = proposers[-1].last_draft
                rows = logprobs[:-1]
                draft_logprob = mx.take_along_axis(rows, draft[:, None].astype(mx.int32), axis=-1)[:, 0]
                wrong = mx.where(draft_logprob > math.log(0.2), draft, tokens[:-1].astype(draft.dtype))
                tokens = mx.concatenate([wrong.astype(tokens.dtype), tokens[-1:]])
            return tokens

        return biased

    monkeypatch.setattr(generate_module, "make_sampler", biased_make_sampler)
    exact = exact_distributions(model, 1.0, 0.0)
    samples, accepted = sample_many(model, make_tokenizer(()), N_BIASED, 11, TrackedOracle, temp=1.0)
    assert accepted > 0.25 * N_BIASED
    p = pvalues(samples, exact)
    assert p["t1"] < P_BIASED, p  # the same statistic that passes the honest rule fails this one
    assert p["t0"] > P_HONEST  # the prefill's token is untouched by the trick


def test_same_seed_same_tokens_different_seed_different(make_tokenizer, targets, drafters):
    model, drafter = targets("qwen3"), drafters("qwen3")

    def sample(seed):
        return [t for e in stream_generate(model, make_tokenizer(()), [5, 6, 7, 8], draft_model=drafter,
                                           max_tokens=40, temp=1.0, top_p=0.95, seed=seed, block_size=6)
                for t in e.tokens]

    first = sample(1)
    mx.random.seed(12345)  # whatever happened to the global stream in between
    assert sample(1) == first
    assert len(first) == 40
    assert sample(2) != first
