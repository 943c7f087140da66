"""DFlash2's candidate selector: one left-to-right walk over each block position's top-k tokens.

Position t keeps the drafter's k best tokens. A candidate c scores its own logit plus a
low-rank edge term between the token chosen at t - 1 (the anchor, i.e. the last committed
token, for t = 0) and c: sum_r P[prev, r] * h_t[r] * S[c, r], with P/S the predecessor and
successor codebooks and h_t the position's hidden state projected to rank r. Greedy takes
the best score; sampling draws from q_t = softmax(score / temperature) and returns q_t, the
proposal distribution the verifier's rejection test needs. The walk is sequential by nature
(each step needs the previous choice); everything else is computed for all positions at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class Selection:
    """A walk's outcome for a batch of blocks of n positions."""

    tokens: mx.array  # (B, n) the chosen token per position
    candidates: mx.array  # (B, n, k) each position's top-k token ids
    q: mx.array | None  # (B, n, k) sampling distribution over the candidates (None: greedy)


def edge_scores(predecessor: mx.array, successors: mx.array) -> mx.array:
    """Edge term: predecessor codes (B, r) against position-modulated successor codes (B, k, r) -> (B, k)."""
    return (successors @ predecessor[:, :, None])[..., 0]


def walk(
    unary: mx.array,
    candidates: mx.array,
    successors: mx.array,
    predecessor_codebook: mx.array,
    anchor: mx.array,
    temperature: float = 0.0,
) -> Selection:
    """The sequential part. unary (B, n, k): the candidates' logits; successors (B, n, k, r):
    successor codes times the projected hidden state; anchor (B,): the token before the block."""
    chosen, rows = [], []
    previous = anchor
    for t in range(unary.shape[1]):
        scores = unary[:, t] + edge_scores(predecessor_codebook[previous], successors[:, t])
        if temperature > 0:
            scaled = scores.astype(mx.float32) * (1.0 / temperature)
            pick = mx.random.categorical(scaled)
            rows.append(mx.softmax(scaled, axis=-1))
        else:
            pick = mx.argmax(scores, axis=-1)
        previous = mx.take_along_axis(candidates[:, t], pick[:, None], axis=-1)[:, 0]
        chosen.append(previous)
    return Selection(mx.stack(chosen, axis=1), candidates, mx.stack(rows, axis=1) if rows else None)


class CandidateSelector(nn.Module):
    """Parameters as the checkpoint names them: `hidden_projection` (a linear map), the two codebooks (plain tables)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))

    def __call__(self, hidden: mx.array, logits: mx.array, anchor: mx.array,
                 temperature: float = 0.0) -> Selection:
        """hidden (B, n, D) final-normed draft states and logits (B, n, V) at the drafted positions."""
        k = self.top_k
        candidates = mx.argpartition(logits, -k, axis=-1)[..., -k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        modulation = self.hidden_projection(hidden)  # (B, n, r)
        successors = self.successor_codebook[candidates] * modulation[:, :, None, :]
        return walk(unary, candidates, successors, self.predecessor_codebook, anchor, temperature)
