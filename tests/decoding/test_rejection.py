"""Speculative rejection sampling (`decoding.sampling`) is exact, and `TargetSampler` states its distribution.

Vectorised over many independent trials: a synthetic target whose next-token
distribution depends on the previous token, a proposal q over top-k candidates
that depends on the previous drafted token too (as DFlash2's selector walk does),
drafts sampled from q, one `rejection_verify` per trial. The first two emitted
tokens must follow the target's joint distribution (chi-square); handing the
verifier a q other than the one the draft came from must fail the same test.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.distributions import chi2_pvalue, filtered
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

from mlx_dflash.decoding.sampling import TargetSampler, make_sampler, rejection_verify
from mlx_dflash.proposers.base import Proposal

V, K, T = 8, 4, 60_000  # vocabulary, candidates per position, trials
P_HONEST, P_BIASED = 1e-4, 1e-6


def _dist(rng, shape, sharp=1.5):
    x = np.exp(sharp * rng.standard_normal(shape))
    return x / x.sum(axis=-1, keepdims=True)


def _synthetic(seed: int):
    """Target tables p0 (V), p1 (V, V) given x0, p2 (V, V, V) given x0, x1; proposal candidates/q
    at position 0 (K) and at position 1 given d0 (V, K)."""
    rng = np.random.default_rng(seed)
    p0, p1, p2 = _dist(rng, (V,)), _dist(rng, (V, V)), _dist(rng, (V, V, V))
    p1[:, 0] = 0.0  # a token the target never emits after any x0 (as top-p/top-k filtering do)
    p1 /= p1.sum(axis=-1, keepdims=True)
    c0 = rng.permutation(V)[:K]
    c1 = np.stack([rng.permutation(V)[:K] for _ in range(V)])
    c1[:, 0] = 0  # ... which the proposal may still draft
    q0, q1 = _dist(rng, (K,), 1.0), _dist(rng, (V, K), 1.0)
    return p0, p1, p2, c0, c1, q0, q1


def _run(tables, seed: int, wrong_q: bool = False):
    """T trials of one cycle with two drafted tokens; returns the first two emitted tokens and a."""
    p0, p1, p2, c0, c1, q0, q1 = tables
    mx.random.seed(seed)
    i0 = mx.random.categorical(mx.log(mx.array(q0, dtype=mx.float32)), shape=(T,))
    d0 = mx.array(c0)[i0]
    rows1 = mx.log(mx.array(q1, dtype=mx.float32))[d0]
    i1 = mx.random.categorical(rows1)
    d1 = mx.take_along_axis(mx.array(c1)[d0], i1[:, None], axis=-1)[:, 0]
    draft = mx.stack([d0, d1], axis=1)
    cands = mx.stack([mx.broadcast_to(mx.array(c0), (T, K)), mx.array(c1)[d0]], axis=1)
    q = mx.stack([mx.broadcast_to(mx.array(q0, dtype=mx.float32), (T, K)), mx.array(q1, dtype=mx.float32)[d0]],
                 axis=1)
    if wrong_q:  # the verifier is told "uniform over the candidates", which is not what the draft came from
        q = mx.full(q.shape, 1.0 / K)
    p = mx.stack([mx.broadcast_to(mx.array(p0, dtype=mx.float32), (T, V)), mx.array(p1, dtype=mx.float32)[d0],
                  mx.array(p2, dtype=mx.float32)[d0, d1]], axis=1)
    tokens, a = rejection_verify(draft, Proposal(cands, q), p)
    tokens, a = np.array(tokens), np.array(a)
    x0 = tokens[:, 0]
    # A cycle that rejected d0 emits one token; the next cycle samples x1 from the target itself.
    fresh = np.array(mx.random.categorical(mx.log(mx.array(p1, dtype=mx.float32))[mx.array(x0)]))
    x1 = np.where(a >= 1, tokens[:, 1], fresh)
    return x0, x1, a


def test_emitted_tokens_follow_the_target_joint_distribution():
    tables = _synthetic(0)
    p0, p1 = tables[0], tables[1]
    x0, x1, a = _run(tables, seed=1)
    assert 0.15 * T < (a >= 1).sum() < 0.95 * T  # drafts are accepted, and rejected
    assert (a == 2).sum() > 0.05 * T
    joint = (p0[:, None] * p1).reshape(-1)
    assert chi2_pvalue(x0, p0) > P_HONEST
    assert chi2_pvalue(x0 * V + x1, joint) > P_HONEST
    assert not np.any(x1 == 0)  # the zero-probability token is never emitted, though it is drafted

    # The verifier given a q the draft did not come from emits another distribution: caught.
    x0, x1, _ = _run(tables, seed=1, wrong_q=True)
    assert min(chi2_pvalue(x0, p0), chi2_pvalue(x0 * V + x1, joint)) < P_BIASED


def test_rejection_accepts_more_than_sample_and_match_when_q_is_close_to_p():
    """With q = p on the candidates, rejection accepts about the candidates' mass; sample-and-match
    (draft from q, accept while the target's own sample agrees) only sum p*q."""
    rng = np.random.default_rng(3)
    p = _dist(rng, (T, 1, V), 2.0)
    cand = np.argsort(-p, axis=-1)[..., :K]
    q = np.take_along_axis(p, cand, axis=-1)
    q /= q.sum(axis=-1, keepdims=True)
    mx.random.seed(4)
    pick = mx.random.categorical(mx.log(mx.array(q[:, 0], dtype=mx.float32)))
    draft = mx.take_along_axis(mx.array(cand[:, 0]), pick[:, None], axis=-1)
    p_full = mx.array(np.concatenate([p, p], axis=1), dtype=mx.float32)  # position 0 and the bonus row
    _, a = rejection_verify(draft, Proposal(mx.array(cand), mx.array(q, dtype=mx.float32)), p_full)
    target_sample = mx.random.categorical(mx.log(p_full[:, 0]))
    matched = np.array(target_sample == draft[:, 0]).mean()
    assert np.array(a).mean() > matched + 0.2, (np.array(a).mean(), matched)


@pytest.mark.parametrize(
    "temp, top_p, min_p, top_k",
    [(1.0, 0.0, 0.0, 0), (0.7, 0.8, 0.0, 0), (1.3, 0.0, 0.1, 0), (0.9, 0.0, 0.0, 5), (0.8, 0.9, 0.05, 6)],
)
def test_target_sampler_states_the_distribution_it_samples(temp, top_p, min_p, top_k):
    rng = np.random.default_rng(7)
    logits = 2.0 * rng.standard_normal(16)
    logprobs = mx.array(logits - np.log(np.exp(logits).sum()), dtype=mx.float32)
    sampler = make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)
    assert isinstance(sampler, TargetSampler)
    probs = np.array(sampler.probs(logprobs[None]))[0].astype(np.float64)
    np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-5)
    if not min_p and not top_k:  # the numpy statement of mlx-lm's semantics (test_sampling)
        np.testing.assert_allclose(probs, filtered(logits[None], temp, top_p)[0], atol=1e-5)
    # The tokens are mlx-lm's own sampler's (same random stream), and follow `probs`.
    mx.random.seed(5)
    ours = np.array(sampler(mx.broadcast_to(logprobs, (20_000, 16))))
    mx.random.seed(5)
    theirs = np.array(mlx_lm_make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)(
        mx.broadcast_to(logprobs, (20_000, 16))))
    np.testing.assert_array_equal(ours, theirs)
    assert chi2_pvalue(ours, probs / probs.sum()) > P_HONEST


def test_greedy_sampler_is_mlx_lms():
    sampler = make_sampler(0.0)
    assert not isinstance(sampler, TargetSampler)
    x = mx.array([[0.1, 2.0, -1.0]])
    assert sampler(x).tolist() == [1]
