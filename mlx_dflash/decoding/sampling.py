"""Sampling that knows its own distribution, and speculative rejection sampling with it.

`TargetSampler` draws exactly what mlx-lm's `make_sampler` draws (it is that sampler)
and can also state the distribution p it draws from (the same filters, the same
order). With a proposer that reports its proposal distribution q (DFlash2's
selector), a verify cycle then accepts each drafted token with probability
min(1, p/q) and, at the first rejection, emits a sample of the normalised residual
(p - q)+: every emitted token is an exact sample of p, and a q close to p accepts
more than sample-and-match (whose per-token acceptance is only sum p*q).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

from ..proposers.base import Proposal


class TargetSampler:
    """mlx-lm's sampler for these settings (temperature > 0), plus `probs`."""

    def __init__(self, temp: float, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0):
        if temp <= 0:
            raise ValueError("TargetSampler is for temperature > 0; greedy has no distribution to state")
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k
        self._sample = mlx_lm_make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._sample(logprobs)

    def probs(self, logprobs: mx.array) -> mx.array:
        """The distribution `__call__` samples from, per row of log-probabilities."""
        # mlx-lm's chain: top-p, then min-p, then top-k on the log-probabilities; then temperature.
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs.astype(mx.float32) * (1.0 / self.temp), axis=-1)


def make_sampler(temp: float, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0) -> Callable[..., mx.array]:
    """mlx-lm's greedy sampler at temperature 0, else a `TargetSampler` (same tokens, plus `probs`)."""
    if temp == 0:
        return mlx_lm_make_sampler(0.0)
    return TargetSampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)


def draft_block(proposer: Any, sampler: Any, last_token: mx.array, position: int,
                block_size: int) -> tuple[mx.array, Proposal | None]:
    """The draft, and its proposal when both sides can do rejection sampling (else None: sample-and-match)."""
    if isinstance(sampler, TargetSampler) and hasattr(proposer, "propose_sampled"):
        return proposer.propose_sampled(last_token, position, block_size, sampler.temp)
    return proposer.propose(last_token, position, block_size), None


def rejection_verify(draft: mx.array, proposal: Proposal, p: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative rejection sampling of one block (any leading batch dims).

    draft (..., n) token ids drawn from `proposal`; p (..., n + 1, V) the target's
    distributions at the n drafted positions and the one after them. Returns the
    cycle's tokens (..., n + 1) (the first a + 1 are emitted) and a (...), the
    number of accepted drafted tokens.
    """
    n = draft.shape[-1]
    ids = draft[..., None].astype(mx.int32)
    p_draft = mx.take_along_axis(p[..., :n, :], ids, axis=-1)[..., 0]
    q_draft = (proposal.q * (proposal.candidates == ids)).sum(axis=-1)
    # Accept d_t with probability min(1, p(d_t) / q(d_t)): u * q < p for u ~ U[0, 1).
    # After the first rejection nothing more is accepted; its token comes from (p - q)+ below.
    accepted = mx.random.uniform(shape=q_draft.shape) * q_draft < p_draft
    a = mx.cumprod(accepted.astype(mx.int32), axis=-1).sum(axis=-1)

    # The emitted token at a: from the residual (p - q)+ normalised, or from p itself when a == n.
    at = a[..., None, None]
    p_row = mx.take_along_axis(p, at, axis=-2)[..., 0, :]
    pad = mx.zeros_like(proposal.q[..., :1, :])
    cand_row = mx.take_along_axis(mx.concatenate([proposal.candidates, pad.astype(proposal.candidates.dtype)],
                                                 axis=-2), at, axis=-2)[..., 0, :].astype(mx.int32)
    q_row = mx.take_along_axis(mx.concatenate([proposal.q, pad], axis=-2), at, axis=-2)[..., 0, :]
    lowered = mx.maximum(mx.take_along_axis(p_row, cand_row, axis=-1) - q_row, 0.0)
    residual = mx.put_along_axis(p_row, cand_row, lowered.astype(p_row.dtype), axis=-1)
    total = residual.sum(axis=-1, keepdims=True)
    # (p - q)+ sums to zero only where p == q, when rejection had probability zero: p is then exact.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_row)
    fix = mx.random.categorical(mx.log(residual))

    padded = mx.concatenate([draft.astype(mx.uint32), mx.zeros_like(draft[..., :1]).astype(mx.uint32)], axis=-1)
    index = mx.arange(n + 1)
    tokens = mx.where(index < a[..., None], padded, fix[..., None].astype(mx.uint32))
    return tokens, a
