"""Loading targets (through mlx-lm) and DFlash drafters (z-lab layout), local or from the Hub."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..convert.build import build_drafter, load_checked
from ..convert.config import rope_overrides
from ..distributed.rank_agreement import check_before_loading
from ..distributed.world import one_rank_at_a_time, shard_target, world
from ..drafters.dflash import DFlashDraftModel
from ..drafters.pairing import check_compatible
from ..errors import DFlashError
from ..targets.dtypes import DTYPES, cast_floats, default_dtype
from ..targets.model import TargetModel, check_forward
from .resolve import drafter_source, resolve_path, target_source

DRAFTER_PATTERNS = ["*.json", "*.safetensors"]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise DFlashError(f"{path.parent}: missing {path.name}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from e


def read_safetensors(directory: Path) -> dict[str, mx.array]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{directory}: no .safetensors weight files")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # MLX raises plain RuntimeError/ValueError on bad files
            raise DFlashError(f"{f}: cannot read safetensors ({str(e).splitlines()[0]})") from e
    return weights


def load_drafter(
    path_or_repo: str | Path,
    target: TargetModel | None = None,
    *,
    dtype: mx.Dtype | None = None,
    revision: str | None = None,
) -> DFlashDraftModel:
    """Load a z-lab DFlash drafter (v1 or DFlash2, by `architectures`); every key and shape is checked.

    Floating-point weights are cast to `dtype`; by default to `target`'s when one is given, else to
    float32 on the CPU (MLX's CPU half-precision matmuls are slower) and left as the checkpoint has
    them elsewhere."""
    path = resolve_path(path_or_repo, DRAFTER_PATTERNS, revision)
    config = _read_json(path / "config.json")
    model = build_drafter(config, str(path), target.num_layers if target is not None else None)
    weights = model.sanitize(read_safetensors(path))
    model.quantize_packed(weights)
    load_checked(model, weights, str(path))
    cast_floats(model, dtype or (target.dtype if target is not None else default_dtype()))
    model.eval()
    mx.eval(model.parameters())
    if target is not None:
        check_compatible(model, target)
    return model


def load_target(path_or_repo: str | Path, *, dtype: mx.Dtype | None = None,
                revision: str | None = None, drafter_dir: Path | None = None) -> tuple[nn.Module, Any]:
    """An mlx-lm model and tokenizer, cast to `dtype` (float32 on the CPU by default).

    Distributed, the ranks first check that they agree on package versions, this target's
    files and those of `drafter_dir` (the drafter the caller loads next), before any weights
    load (`rank_agreement`).
    """
    from mlx_lm.utils import load as mlx_lm_load

    # Short names, .gguf files and PyTorch-only checkpoints go through the converted cache
    # (converted once, by rank 0 first, when ranks share a machine).
    if revision:
        path = resolve_path(path_or_repo, None, revision)
    else:
        path = one_rank_at_a_time(target_source, path_or_repo)
    group = world()
    if group is not None:
        check_before_loading(group, path, drafter_dir)
    if not (path / "config.json").exists():
        raise DFlashError(f"{path}: missing config.json")
    if glob.has_magic(str(path)):
        raise DFlashError(f"{path}: mlx-lm finds weight files with glob, which reads [ ] * ? in this path as "
                          "patterns; move or link the model to a path without them")
    try:
        # transformers-5 configs nest rope_theta; mlx-lm would silently use base 10000.
        # Distributed: loaded lazily, so each rank materialises only its shard.
        model, tokenizer = mlx_lm_load(str(path), model_config=rope_overrides(_read_json(path / "config.json")),
                                       lazy=group is not None)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        # One line, but whole: mlx-lm puts the names of missing weights on the next line.
        raise DFlashError(f"{path}: cannot load target ({' '.join(str(e).split())})") from e
    TargetModel(model)  # fails early, naming the supported families
    if group is not None:
        shard_target(model, group)
    cast_floats(model, dtype)
    try:
        check_forward(TargetModel(model))  # refuses an mlx-lm whose internals drifted from targets/families.py
    except RuntimeError as e:
        if "GatherMM" not in str(e):
            raise
        raise DFlashError(f"MLX's CPU backend computes mixture-of-experts layers in float32 only; this model "
                          f"cannot run in {str(dtype).removeprefix('mlx.core.')} here: drop --dtype") from None
    return model, tokenizer


def load(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    dtype: str | None = None,
) -> tuple[nn.Module, Any, DFlashDraftModel | None]:
    """Load a target (mlx-lm format) and optionally its DFlash drafter.

    Each may be a directory, a Hub repo id or a known short name (`Qwen3-8B`, see
    `mlx_dflash.loading.resolve.KNOWN_PAIRS`); a target may also be a .gguf file or a
    PyTorch-only checkpoint, converted once into the converted-weights cache.

    Returns (model, tokenizer, draft_model) ready for `generate`/`stream_generate`.
    `dtype` is one of float32/float16/bfloat16; default float32 on the CPU.
    """
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    mx_dtype = DTYPES[dtype] if dtype else default_dtype()
    draft_dir = drafter_source(draft) if draft is not None else None
    target_model, tokenizer = load_target(model, dtype=mx_dtype, drafter_dir=draft_dir)
    drafter = None
    if draft_dir is not None:
        target = TargetModel(target_model)
        drafter = load_drafter(draft_dir, target, dtype=mx_dtype)
    return target_model, tokenizer, drafter
