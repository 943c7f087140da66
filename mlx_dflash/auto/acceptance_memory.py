"""What `--block-size auto` learnt about a drafter's acceptance, kept for the next run.

A one-shot `generate` lasts a few dozen cycles, and learning from nothing that a drafter
is weak (or strong) costs a noticeable share of them. The policy's per-position counts
are saved per target + drafter pair, told apart by their shapes and a fingerprint of
their weights, and seed the next run's estimates at reduced weight: what the new text
shows takes over within a few cycles. Kept as JSON beside the calibrations
(`calibration.cache_file`); a file that cannot be read is ignored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..platform.files import write_json_atomic
from ..proposers.factory import check_block_size
from ..targets.model import as_target
from .calibration import cache_file, calibration_key
from .estimators import AcceptanceModel

VERSION = 1
SEED_WEIGHT = 4.0  # observations a remembered position counts for, at most


FINGERPRINT_SAMPLES = 4096  # elements read from each of the first and last parameter arrays


def _fingerprint(model: nn.Module) -> list[float]:
    """Sums of evenly spaced samples of the first and last parameter arrays: tells trained weights
    apart without converting them (a float32 copy of an 8B target's embedding is 2.5 GB)."""
    arrays = [a for _, a in tree_flatten(model.parameters())]
    sums = []
    for a in [arrays[0], arrays[-1]] if arrays else []:
        flat = a.reshape(-1)
        sample = flat[:: max(flat.size // FINGERPRINT_SAMPLES, 1)]  # a strided view, not a copy
        sums.append(round(float(mx.sum(sample.astype(mx.float32)).item()), 3))
    return sums


def memory_file(target: Any, drafter: nn.Module) -> Path:
    target = as_target(target)
    key = {"shapes": calibration_key(target, drafter), "target": _fingerprint(target.model),
           "drafter": _fingerprint(drafter)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_file(key["shapes"]).parent / f"acceptance-{target.model_type}-{digest}.json"


def recall(target: Any, drafter: nn.Module) -> AcceptanceModel | None:
    """The acceptance estimates earlier runs of this pair left, scaled down to SEED_WEIGHT
    observations per position; None when there are none (or they cannot be read)."""
    depth = check_block_size(None, drafter) - 1
    try:
        data = json.loads(memory_file(target, drafter).read_text())
        reached, accepted = [float(x) for x in data["reached"]], [float(x) for x in data["accepted"]]
        if data.get("version") != VERSION or len(reached) != depth or len(accepted) != depth:
            return None
        if any(not 0 <= a <= r for a, r in zip(accepted, reached, strict=True)):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    remembered = AcceptanceModel(depth, reached=reached, accepted=accepted)
    remembered.forget(SEED_WEIGHT)
    return remembered


def seed(calibration: Any, target: Any, drafter: nn.Module) -> Any:
    """Give `calibration` what earlier runs learnt of this pair's acceptance (else a blank
    model): the policies made from it share and update it; `remember` saves it afterwards."""
    calibration.acceptance = recall(target, drafter) or AcceptanceModel(check_block_size(None, drafter) - 1)
    return calibration


def remember(target: Any, drafter: nn.Module, acceptance: AcceptanceModel) -> str | None:
    """Save what `acceptance` learnt for the next run; returns a warning when it cannot."""
    if not any(acceptance.reached):
        return None
    path = memory_file(target, drafter)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"version": VERSION, "reached": acceptance.reached,
                                 "accepted": acceptance.accepted})
    except OSError as e:
        return f"could not save what auto learnt about the drafter ({e.strerror or e})"
    return None
