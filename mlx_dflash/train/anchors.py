"""Anchors and batches: where the training blocks start, and padded batch arrays.

An anchor is the position of a known token that starts a draft block, as the
last committed token does at inference; the block then predicts positions
anchor+1 .. anchor+block_size-1. Anchors are drawn where the first predicted
token is an assistant token, many per sequence, without repetition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .data import Example


def anchor_candidates(mask: Sequence[bool]) -> np.ndarray:
    """Positions a whose next token (a + 1) is an assistant token."""
    m = np.asarray(mask, dtype=bool)
    return np.flatnonzero(m[1:])


def sample_anchors(mask: Sequence[bool], num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `num_blocks` distinct anchors, sorted; all candidates when there are fewer."""
    candidates = anchor_candidates(mask)
    if len(candidates) > num_blocks:
        candidates = np.sort(rng.choice(candidates, size=num_blocks, replace=False))
    return candidates.astype(np.int32)


@dataclass
class Batch:
    """Padded arrays for one micro-batch (numpy; the trainer moves them to MLX)."""

    tokens: np.ndarray  # (B, T) token ids, padded with pad_id
    loss_mask: np.ndarray  # (B, T) True on assistant tokens
    anchors: np.ndarray  # (B, N) block start positions, 0 where padded
    anchor_valid: np.ndarray  # (B, N) False for padding anchors

    @property
    def num_blocks(self) -> int:
        return int(self.anchor_valid.sum())


def make_batch(examples: Sequence[Example], num_blocks: int, rng: np.random.Generator,
               pad_id: int = 0) -> Batch:
    """Pad examples to a common length and draw each one's anchors."""
    T = max(len(e.ids) for e in examples)
    B = len(examples)
    tokens = np.full((B, T), pad_id, dtype=np.int32)
    loss_mask = np.zeros((B, T), dtype=bool)
    drawn = [sample_anchors(e.mask, num_blocks, rng) for e in examples]
    N = max(1, max(len(a) for a in drawn))
    anchors = np.zeros((B, N), dtype=np.int32)
    valid = np.zeros((B, N), dtype=bool)
    for i, (e, a) in enumerate(zip(examples, drawn, strict=True)):
        tokens[i, : len(e.ids)] = e.ids
        loss_mask[i, : len(e.mask)] = e.mask
        anchors[i, : len(a)] = a
        valid[i, : len(a)] = True
    return Batch(tokens, loss_mask, anchors, valid)
