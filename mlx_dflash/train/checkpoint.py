"""Training checkpoints: everything needed to continue a run exactly.

A checkpoint directory holds the drafter weights (full precision), the
optimizer state, and state.json: the step, the training config, the data
stream position and the anchor RNG state. It is written to a sibling
directory and renamed into place, so an interrupted save never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import DFlashError

CHECKPOINT_DIR = "checkpoint"
FORMAT_VERSION = 1
EXTRA_FILE = "extra.safetensors"


@dataclass
class CheckpointState:
    step: int
    config: dict[str, Any]
    data: dict[str, int]
    rng: dict[str, Any]
    elapsed: float = 0.0  # training seconds spent before this checkpoint


def save_checkpoint(out_dir: Path, drafter: nn.Module, optimizer: optim.Optimizer, state: CheckpointState,
                    drafter_config: dict[str, Any], extra: dict[str, mx.array] | None = None) -> Path:
    """Write the checkpoint; `extra` holds arrays the run needs besides weights (e.g. the feature scale)."""
    final = out_dir / CHECKPOINT_DIR
    tmp = out_dir / f"{CHECKPOINT_DIR}.tmp"
    old = out_dir / f"{CHECKPOINT_DIR}.old"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "drafter.safetensors"), dict(tree_flatten(drafter.parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
        if extra:
            mx.save_safetensors(str(tmp / EXTRA_FILE), extra)
        (tmp / "config.json").write_text(json.dumps(drafter_config, indent=2) + "\n")
        (tmp / "state.json").write_text(json.dumps({
            "format_version": FORMAT_VERSION, "step": state.step, "config": state.config, "data": state.data,
            "rng": state.rng, "elapsed": state.elapsed,
        }, indent=2) + "\n")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise DFlashError(f"{out_dir}: cannot write the checkpoint ({e.strerror or e})") from None
    return final


def read_state(out_dir: Path) -> CheckpointState:
    path = out_dir / CHECKPOINT_DIR / "state.json"
    if not path.exists():
        raise DFlashError(f"{out_dir}: no checkpoint to resume from (expected {path})")
    try:
        raw = json.loads(path.read_text())
        return CheckpointState(raw["step"], raw["config"], raw["data"], raw["rng"], raw.get("elapsed", 0.0))
    except (json.JSONDecodeError, KeyError) as e:
        raise DFlashError(f"{path}: damaged checkpoint state ({e})") from None


def load_weights(out_dir: Path, drafter: nn.Module, optimizer: optim.Optimizer) -> None:
    """Restore the drafter's weights and the optimizer's state (moments, step) in place."""
    ckpt = out_dir / CHECKPOINT_DIR
    try:
        drafter.load_weights(str(ckpt / "drafter.safetensors"), strict=True)
        state = mx.load(str(ckpt / "optimizer.safetensors"))
    except (ValueError, RuntimeError, OSError) as e:
        raise DFlashError(f"{ckpt}: cannot read the checkpoint ({str(e).splitlines()[0]})") from None
    optimizer.init(drafter.trainable_parameters())
    optimizer.state = tree_unflatten(list(state.items()))
    mx.eval(drafter.parameters(), optimizer.state)


def load_extra(out_dir: Path) -> dict[str, mx.array]:
    """The checkpoint's extra arrays ({} for a checkpoint written without any)."""
    path = out_dir / CHECKPOINT_DIR / EXTRA_FILE
    if not path.exists():
        return {}
    try:
        return mx.load(str(path))
    except (ValueError, RuntimeError, OSError) as e:
        raise DFlashError(f"{path}: cannot read the checkpoint ({str(e).splitlines()[0]})") from None
