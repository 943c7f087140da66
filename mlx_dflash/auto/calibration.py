"""Calibration for `--block-size auto`: what a cycle of each block size costs on this machine.

A short probe runs real cycles of every candidate size (drafting, verifying, committing
one token, exactly as decoding does) at a short and a longer context, and fits
seconds = a + b * context per size; asked to, and where the pair verifies draft trees, the
same for a spine tree of each budget `--tree-budget auto` weighs. The result seeds the
policy's cost model, so that its first cycles are already right; decoding then keeps
correcting it.

Costs depend on the machine, the model's shapes, its dtype and quantization, and the
drafter's shapes, not on the weights' values: the cache key is made of exactly those.
Results are cached as JSON under `$MLX_DFLASH_CACHE/calibration/` (default
`~/.cache/mlx-dflash`; `$MLX_DFLASH_CALIBRATION_DIR` overrides the folder). A file
that cannot be read or was made for something else is ignored, and the reason is
returned for the caller to show.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_sampler

from ..decoding.session import DecodingSession
from ..decoding.tree import SPINE
from ..drafters.dflash import DFlashDraftModel
from ..platform.files import cache_dir, write_json_atomic
from ..platform.setup import machine
from ..proposers.factory import dflash_proposer
from ..targets.model import TargetModel, as_target
from .policy import TREE_BUDGETS, candidate_sizes

VERSION = 3  # 3: the fastest of 6 timed cycles (of 3, the price ratio of blocks 16 and 8 varied 1.29-1.48)
DIR_ENV = "MLX_DFLASH_CALIBRATION_DIR"  # where calibrations are kept (tests point it elsewhere)
CONTEXTS = (64, 1024)  # token counts the costs are measured at (fit: linear in between)
REPEATS = 6  # timed cycles per size and context (the fastest is kept)

Progress = Callable[[int, int], None]


@dataclass
class Calibration:
    key: dict[str, Any]
    costs: dict[int, tuple[float, float]]  # block size -> (seconds at context 0, seconds per context token)
    seconds: float = 0.0  # how long the probe took
    # Spine-tree budget -> (seconds at context 0, per context token), of the widest block; None: not
    # measured; empty: the pair verifies no trees.
    tree_costs: dict[int, tuple[float, float]] | None = None
    # What earlier runs learnt of this pair's acceptance (`acceptance_memory`); the policies made
    # from this calibration share and update it, so that it can be saved for the next run.
    acceptance: Any = None

    def to_json(self) -> dict[str, Any]:
        trees = None if self.tree_costs is None else {str(b): list(ab) for b, ab in self.tree_costs.items()}
        return {"version": VERSION, "key": self.key, "seconds": self.seconds,
                "costs": {str(size): list(ab) for size, ab in self.costs.items()}, "tree_costs": trees}


def _quantization(model: nn.Module) -> str:
    bits = sorted({(m.bits, m.group_size) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)})
    return ",".join(f"q{b}g{g}" for b, g in bits) or "none"


def calibration_key(target: TargetModel, drafter: DFlashDraftModel) -> dict[str, Any]:
    """What a cycle's cost depends on: the machine and both models' shapes, dtype, quantization."""
    args = target.args
    return {
        "machine": machine(),
        "target": {
            "model_type": target.model_type, "layers": target.num_layers, "hidden": target.hidden_size,
            "vocab": target.vocab_size, "heads": getattr(args, "num_attention_heads", None),
            "kv_heads": getattr(args, "num_key_value_heads", None),
            "intermediate": getattr(args, "intermediate_size", None),
            "dtype": str(target.dtype), "quantization": _quantization(target.model),
        },
        "drafter": {
            "layers": drafter.args.num_hidden_layers, "hidden": drafter.args.hidden_size,
            "block_size": drafter.block_size, "target_layer_ids": list(drafter.target_layer_ids),
            "dtype": str(drafter.norm.weight.dtype), "quantization": _quantization(drafter),
        },
    }


def cache_file(key: dict[str, Any]) -> Path:
    folder = os.environ.get(DIR_ENV) or cache_dir() / "calibration"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder).expanduser() / f"{key['target']['model_type']}-{digest}.json"


def load_calibration(key: dict[str, Any]) -> tuple[Calibration | None, str | None]:
    """The cached calibration for `key`, or None with the reason when a file exists but is unusable."""
    path = cache_file(key)
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("key") != key:
            return None, f"ignoring the stale calibration {path} (made by another version or for another setup)"
        costs = {int(size): (float(a), float(b)) for size, (a, b) in data["costs"].items()}
        trees = data.get("tree_costs")
        trees = None if trees is None else {int(b): (float(t0), float(t1)) for b, (t0, t1) in trees.items()}
        if not costs or any(a <= 0 or b < 0 for a, b in [*costs.values(), *(trees or {}).values()]):
            raise ValueError("non-positive costs")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"ignoring the unreadable calibration {path} ({e})"
    return Calibration(key, costs, float(data.get("seconds", 0.0)), tree_costs=trees), None


def save_calibration(calibration: Calibration) -> Path:
    path = cache_file(calibration.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, calibration.to_json(), indent=1)  # a concurrent reader sees old or new
    return path


def measure(
    model: nn.Module | TargetModel,
    drafter: DFlashDraftModel | None,
    *,
    contexts: tuple[int, ...] = CONTEXTS,
    repeats: int = REPEATS,
    progress: Progress | None = None,
    proposer: Any = None,
    trees: bool = False,
) -> Calibration:
    """Time real decoding cycles of every candidate block size at each context length, and with
    `trees` (where the pair verifies them) of a spine tree of each of `TREE_BUDGETS` of the widest block.

    `proposer` (instead of a drafter) measures another proposer, with its `block_size`
    (the benchmark's proposers of known quality: their drafting costs nothing).
    """
    target = as_target(model)
    widest = drafter.block_size if proposer is None else proposer.block_size
    sizes = candidate_sizes(widest)
    limit = getattr(target.args, "max_position_embeddings", None) or 2 * max(contexts)
    contexts = tuple(sorted({min(c, max(limit // 2, 8)) for c in contexts}))  # room for the cycles
    sampler = make_sampler(0.0)
    started = time.perf_counter()
    samples: dict[Any, list[tuple[int, float]]] = {size: [] for size in sizes}
    budgets: tuple[int, ...] = ()
    done, total = 0, len(contexts) * len(sizes) * (repeats + 1)
    for context in contexts:
        # Any token ids do: costs do not depend on what the text says.
        session = DecodingSession(target, proposer or dflash_proposer(drafter, target, max_block_size=widest))
        session.extend([(7 * i + 11) % target.vocab_size for i in range(context)], sampler)
        if trees and context == contexts[0] and session.tree_refusal() is None and widest > 2:
            budgets = TREE_BUDGETS
            samples.update({("tree", b): [] for b in budgets})
            total = len(contexts) * (len(sizes) + len(budgets)) * (repeats + 1)
        kinds = [*sizes, *(("tree", b) for b in budgets)]
        for rep in range(repeats + 1):  # the first pass warms up (allocation, kernel setup)
            times = []
            for kind in kinds:
                size, tree = (widest, (kind[1], SPINE, max(budgets))) if isinstance(kind, tuple) else (kind, None)
                session.prepare(size)
                start = time.perf_counter()
                verified = session.step(sampler, size, tree=tree)
                session.keep(verified, 1)
                times.append(time.perf_counter() - start)
                done += 1
                if progress is not None:
                    progress(done, total)
            if rep:
                for kind, seconds in zip(kinds, times, strict=True):
                    samples[kind].append((context, seconds))
    costs = _fit(samples, sizes, contexts)
    tree_costs = _fit(samples, [("tree", b) for b in budgets], contexts) if trees else None
    mx.clear_cache()
    key = calibration_key(target, drafter) if proposer is None else {
        "machine": machine(), "proposer": type(proposer).__name__, "block_size": widest}
    return Calibration(key, costs, time.perf_counter() - started,
                       tree_costs=None if tree_costs is None else {k[1]: ab for k, ab in tree_costs.items()})


def _fit(samples: dict[Any, list[tuple[int, float]]], kinds: list[Any], contexts: tuple[int, ...]) -> dict:
    """(seconds at context 0, per context token) per kind, from the fastest cycle at each context;
    in `kinds`' order, a later one never cheaper (noise aside, a wider verify never costs less)."""
    out, floor = {}, (1e-6, 0.0)
    lo, hi = contexts[0], contexts[-1]
    for kind in kinds:
        t_lo, t_hi = _fastest_at(samples[kind], lo), _fastest_at(samples[kind], hi)
        slope = max((t_hi - t_lo) / (hi - lo), 0.0) if hi > lo else 0.0
        floor = (max(t_lo - slope * lo, floor[0]), max(slope, floor[1]))
        out[kind] = floor
    return out


def _fastest_at(points: list[tuple[int, float]], context: int) -> float:
    # Other work on the machine only ever adds time: the fastest cycle is the one least disturbed.
    return min(s for c, s in points if c == context)


def calibrate(
    model: nn.Module | TargetModel,
    drafter: DFlashDraftModel | None,
    *,
    refresh: bool = False,
    progress: Progress | None = None,
    trees: bool = False,
) -> tuple[Calibration | None, str | None]:
    """The cached calibration, or a fresh one (measured and saved) when there is none, when
    `refresh`, or when `trees` asks for the draft trees' costs and it has none; returns it and a
    warning for the caller to show (None when all went well)."""
    if drafter is None:
        return None, None
    target = as_target(model)
    key = calibration_key(target, drafter)
    warning = None
    if not refresh:
        cached, warning = load_calibration(key)
        if cached is not None and (cached.tree_costs is not None or not trees):
            return cached, None
    calibration = measure(target, drafter, progress=progress, trees=trees)
    try:
        save_calibration(calibration)
    except OSError as e:
        warning = f"could not save the calibration ({e.strerror or e}); it will be measured again next time"
    return calibration, warning
