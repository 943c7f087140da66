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
from scipy.stats import chisquare
from tiny import OracleProposer, tiny_target

from mlx_dflash import stream_generate

# The module, not the `generate` function that `mlx_dflash` re-exports under the same name.
generate_module = importlib.import_module("mlx_dflash.generate")

VOCAB = 16
PROMPT = [5, 9, 4, 12]
SEED = 2  # a tiny target whose next-token distributions are neither flat nor one-hot
P_HONEST = 1e-4  # fixed seeds make every p-value deterministic; an honest run stays far above
P_BIASED = 1e-6


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", seed=SEED, vocab=VOCAB, num_layers=2)  # 2 layers: faster sampling


def _logits(model, prefixes: list[list[int]]) -> np.ndarray:
    """Target logits (float64) after each PROMPT + prefix, computed by the mlx-lm model itself."""
    batch = mx.array([PROMPT + p for p in prefixes], dtype=mx.uint32)
    return np.array(model(batch)[:, -1].astype(mx.float32), dtype=np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_p_keep(logprobs: np.ndarray, top_p: float) -> tuple[np.ndarray, float]:
    """mlx-lm's apply_top_p: keep a token iff the probability mass strictly above it is < top_p.

    Also returns the smallest distance of any token's mass-above to the threshold, so a
    test can check that float rounding cannot flip a decision.
    """
    probs = np.exp(logprobs)
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=-1)
    above = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the tokens more probable than each
    keep_sorted = above < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return keep, float(np.abs(above - top_p).min())


def filtered(logits: np.ndarray, temp: float, top_p: float, order: str = "mlx-lm") -> np.ndarray:
    """The sampling distribution make_sampler(temp, top_p) draws from, per row.

    order="mlx-lm": top-p on the temperature-1 distribution, then temperature (what
    mlx-lm does); order="temperature-first" is the other convention, for contrast.
    """
    logprobs = _log_softmax(logits)
    keep = np.ones_like(logprobs, dtype=bool)
    if 0 < top_p < 1:
        basis = logprobs if order == "mlx-lm" else _log_softmax(logits / temp)
        keep, margin = top_p_keep(basis, top_p)
        assert margin > 1e-5, "top-p threshold too close to a cumulative mass; pick another top_p"
    scaled = np.where(keep, logprobs / temp, -np.inf)
    return np.exp(_log_softmax(scaled))


def exact_distributions(model, temp: float, top_p: float, order: str = "mlx-lm"):
    """P(t0), P(t1), P(t2) and the joint P(t1, t2) of the first three generated tokens."""
    v = VOCAB
    q0 = filtered(_logits(model, [[]]), temp, top_p, order)[0]  # (v,)
    q1 = filtered(_logits(model, [[a] for a in range(v)]), temp, top_p, order)  # (v, v): [t0, t1]
    pairs = [[a, b] for a in range(v) for b in range(v)]
    q2 = filtered(_logits(model, pairs), temp, top_p, order).reshape(v, v, v)  # [t0, t1, t2]
    joint = q0[:, None, None] * q1[:, :, None] * q2  # P(t0, t1, t2)
    return {
        "t0": joint.sum(axis=(1, 2)),
        "t1": joint.sum(axis=(0, 2)),
        "t2": joint.sum(axis=(0, 1)),
        "t1t2": joint.sum(axis=0).reshape(-1),
    }


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expected below 5 are pooled into one."""
    n = len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = n * probs
    small = expected < 5
    if observed[expected == 0].sum():
        return 0.0  # a token of probability zero was emitted: certainly not this distribution
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


class MemoOracle(OracleProposer):
    """OracleProposer with the greedy continuations memoised (the same few prefixes recur)."""

    memo: dict = {}  # id(model) -> (model, {prefix: draft}); holding the model keeps its id unique

    def propose(self, last_token, position, block_size):
        _, table = self.memo.setdefault(id(self.model), (self.model, {}))
        key = (tuple(self.tokens), int(last_token.item()), block_size)
        if key not in table:
            table[key] = np.array(super().propose(last_token, position, block_size))
            self.proposals -= 1
        draft = table[key].tolist()
        self.pending = [int(last_token.item())] + draft
        self.last_draft = mx.array(draft, dtype=mx.uint32)
        self.proposals += 1
        return self.last_draft


def sample_many(model, tokenizer, n: int, seed: int, proposer_cls=MemoOracle, **kwargs) -> tuple[np.ndarray, int]:
    """n generations of 3 tokens; returns (n, 3) tokens and how many drafts were accepted."""
    mx.random.seed(seed)  # once: the runs continue the same random stream
    out = np.zeros((n, 3), dtype=np.int64)
    accepted = 0
    for i in range(n):
        proposer = proposer_cls(model, PROMPT)
        tokens = []
        for event in stream_generate(model, tokenizer, PROMPT, draft_model=proposer, max_tokens=3,
                                     block_size=4, **kwargs):
            tokens += event.tokens
            accepted += event.num_draft_accepted
        out[i] = tokens
    return out, accepted


def pvalues(samples: np.ndarray, exact: dict) -> dict:
    return {
        "t0": chi2_pvalue(samples[:, 0], exact["t0"]),
        "t1": chi2_pvalue(samples[:, 1], exact["t1"]),
        "t2": chi2_pvalue(samples[:, 2], exact["t2"]),
        "t1t2": chi2_pvalue(samples[:, 1] * VOCAB + samples[:, 2], exact["t1t2"]),
    }


N = 2000  # per configuration; ~5 ms per 3-token generation on the CPU
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
