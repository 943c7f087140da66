"""Per-channel scaling of the target features that `fc` reads, folded away at export.

Some targets carry massive activations: SmolLM2-135M's channel 507 reaches
~25,000 from layer 14 on, against a median channel RMS of ~10. With raw
features every AdamW step moves `fc`'s output along those channels by
lr x 25,000, which drowns the context. Training reads features divided by
their per-channel RMS instead; since `fc` is linear, exporting
`W / scale` (column-wise) gives a drafter in the unchanged z-lab layout whose
forward on raw features equals the trained one on scaled features.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..drafters.dflash import DFlashDraftModel
from .recipe import MIN_SCALE


def feature_scale(features: Iterable[mx.array]) -> mx.array:
    """Per-channel RMS over every position of every (B, T, C) array, floored at MIN_SCALE."""
    total, count = None, 0
    for f in features:
        f = f.astype(mx.float32).reshape(-1, f.shape[-1])
        s = (f * f).sum(axis=0)
        total = s if total is None else total + s
        count += f.shape[0]
    if total is None or count == 0:
        raise ValueError("feature_scale needs at least one position")
    rms = mx.sqrt(total / count)
    return mx.where(rms < MIN_SCALE, 1.0, rms)


def fold_feature_scale(drafter: DFlashDraftModel, scale: mx.array) -> DFlashDraftModel:
    """A copy of a drafter trained on `features / scale` that takes raw features."""
    weights = dict(tree_flatten(drafter.parameters()))
    fc = weights["fc.weight"]
    weights["fc.weight"] = (fc.astype(mx.float32) / scale[None, :]).astype(fc.dtype)
    copy = DFlashDraftModel(drafter.args)
    copy.load_weights(list(weights.items()))
    mx.eval(copy.parameters())
    return copy
