"""Exact sampling distributions of tiny targets, and the goodness-of-fit tests that hold samples to them.

On a 16-token vocabulary the distribution of the first generated tokens is enumerated in numpy
from the target's logits for every prefix, with mlx-lm's `make_sampler` semantics; samples from
DFlash generations are compared with it by chi-square (`pvalues`), or, for longer generations, by
the randomised probability integral transform of every token (`pit_pvalue`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from scipy.stats import chisquare

from helpers.tiny import OracleProposer
from mlx_dflash import stream_generate

VOCAB = 16
PROMPT = [5, 9, 4, 12]
SEED = 2  # a tiny target whose next-token distributions are neither flat nor one-hot
P_HONEST = 1e-4  # fixed seeds make every p-value deterministic; an honest run stays far above


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

# Longer generations: every token's randomised PIT under the target's distribution is uniform.
P_BROKEN = 1e-6  # a broken path fails far below this
BINS = 20


def target_distribution(logits: mx.array, temp: float, top_p: float = 0.0, top_k: int = 0,
                        min_p: float = 0.0) -> np.ndarray:
    """What make_sampler(temp, top_p, min_p, top_k) draws from, row by row (float64)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k:
        logprobs = apply_top_k(logprobs, top_k)
    scaled = np.array((logprobs / temp).astype(mx.float32), dtype=np.float64)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    return probs / probs.sum(axis=-1, keepdims=True)


def pit_pvalue(model, prompts: list[list[int]], outputs: list[list[int]], seed: int, **sampling) -> float:
    """Chi-square p-value of the randomised PIT of every output token under the target's distribution."""
    rng = np.random.default_rng(seed)
    u = []
    for prompt, out in zip(prompts, outputs, strict=True):
        logits = model(mx.array([prompt + out[:-1]], dtype=mx.uint32))[0, len(prompt) - 1 :]
        probs = target_distribution(logits, **sampling)
        for q, token in zip(probs, out, strict=True):
            if q[token] == 0:
                return 0.0  # a token the target could not have sampled
            above = q[q > q[token]].sum() + q[(q == q[token]) & (np.arange(len(q)) < token)].sum()
            u.append(above + rng.random() * q[token])
    observed = np.histogram(u, bins=BINS, range=(0.0, 1.0))[0]
    return float(chisquare(observed).pvalue)
