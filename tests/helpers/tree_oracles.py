"""Proposers that draft trees from a known answer: they score each block position as a drafter would,
with the target's own next token placed where the test wants it, so that accepted branches leave the
spine and every part of a tree cycle (mask, positions, compaction, the drafter's context) is exercised."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def greedy_chain(model, seq: list[int], n: int) -> list[int]:
    """The target's greedy continuation of `seq`, `n` tokens."""
    out = list(seq)
    for _ in range(n):
        out.append(int(mx.argmax(model(mx.array([out], dtype=mx.uint32))[0, -1]).item()))
    return out[len(seq):]


class RankOracle:
    """Scores each draft position with the target's greedy token at a random rank: 0 (the argmax) with
    probability `p_first`, else 1 or 2, so a linear draft breaks where a tree's second branch goes on.
    The draws depend on the absolute position only: runs that reach a position draft it alike."""

    drafts_trees = True

    def __init__(self, model, vocab: int, *, p_first: float = 0.6, seed: int = 0, history=None):
        self.model, self.vocab, self.p_first, self.history = model, vocab, p_first, history
        self.seed = seed
        self.target_layer_ids = [0]

    def draft_logits(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        seq = self.history()[: position + 1]
        truth = greedy_chain(self.model, seq, block_size - 1)
        rows = []
        for depth, token in enumerate(truth):
            rng = np.random.default_rng([self.seed, position + depth])
            scores = np.sort(rng.normal(size=self.vocab))[::-1] * 2.0
            rank = 0 if rng.random() < self.p_first else int(rng.integers(1, 3))
            others = [t for t in rng.permutation(self.vocab).tolist() if t != token]
            order = others[:rank] + [token] + others[rank:]
            row = np.empty(self.vocab, dtype=np.float32)
            row[order] = scores
            rows.append(row)
        return mx.array(np.stack(rows))

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        return mx.argmax(self.draft_logits(last_token, position, block_size), axis=-1).astype(mx.uint32)

    def commit(self, features, position: int) -> None:
        pass

    def trim(self, num_positions: int) -> None:
        pass

    def state_arrays(self) -> list:
        return []


class LogitOracle(RankOracle):
    """Scores each draft position with the target's own logits along its greedy path: sampled tokens
    other than the argmax are often on a tree's other branches."""

    def draft_logits(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        seq = self.history()[: position + 1]
        chain = greedy_chain(self.model, seq, block_size - 2)
        return self.model(mx.array([seq + chain], dtype=mx.uint32))[0, len(seq) - 1 :]


def decode_cycles(target, proposer, prompt: list[int], max_tokens: int, policy, sampler=None):
    """Decode `max_tokens` after `prompt` through `DecodingSession.cycle` with `policy`: the session, and
    each cycle's (block size, what it verified). An oracle reads the session's committed tokens."""
    from mlx_dflash.decoding.sampling import make_sampler
    from mlx_dflash.decoding.session import DecodingSession

    session = DecodingSession(target, proposer)
    if hasattr(proposer, "history"):
        proposer.history = lambda: session.tokens
    sampler = sampler or make_sampler(0.0)
    session.extend(prompt, sampler)
    cycles = []
    while len(session.tokens) < len(prompt) + max_tokens:
        size, verified, _ = session.cycle(sampler, policy, len(prompt) + max_tokens - len(session.tokens), set())
        cycles.append((size, verified))
    return session, cycles
