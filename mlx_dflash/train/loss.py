"""Position-decayed cross-entropy over draft blocks, and the labels it is taken against.

Block position k (1..B-1) is weighted exp(-(k - 1) / gamma): a miss at an early
position ends acceptance, so early positions matter most.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .recipe import DEFAULT_GAMMA, default_gamma, position_weight_values

__all__ = ["DEFAULT_GAMMA", "block_labels", "decayed_cross_entropy", "default_gamma", "position_weights"]


def position_weights(block_size: int, gamma: float | None = None) -> mx.array:
    """(block_size - 1,) weights for block positions 1..block_size-1."""
    return mx.array(position_weight_values(block_size, gamma), dtype=mx.float32)


def block_labels(labels_seq: mx.array, loss_mask: mx.array, anchors: mx.array, anchor_valid: mx.array,
                 block_size: int) -> tuple[mx.array, mx.array]:
    """Labels and validity (B, N, block_size - 1) of the positions each block predicts.

    labels_seq[b, t] is the token wanted at position t; a position counts when it
    is inside the sequence, an assistant token, and its block is a real one.
    """
    B, T = labels_seq.shape
    N = anchors.shape[1]
    pos = anchors[:, :, None] + mx.arange(1, block_size)[None, None, :]  # (B, N, bs-1)
    inside = pos < T
    flat = mx.minimum(pos, T - 1).reshape(B, -1)
    labels = mx.take_along_axis(labels_seq, flat, axis=1).reshape(B, N, block_size - 1)
    wanted = mx.take_along_axis(loss_mask, flat, axis=1).reshape(B, N, block_size - 1)
    valid = inside & wanted & anchor_valid[:, :, None]
    return labels, valid


def decayed_cross_entropy(logits: mx.array, labels: mx.array, valid: mx.array, weights: mx.array
                          ) -> tuple[mx.array, mx.array]:
    """Weighted mean CE over valid positions, and the per-position argmax hits (for metrics).

    logits: (..., bs-1, V); labels, valid: (..., bs-1); weights: (bs-1,).
    """
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    w = weights * valid.astype(logits.dtype)
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-6)
    hits = (mx.argmax(logits, axis=-1) == labels) & valid
    return loss, hits
