"""Loading targets (through mlx-lm) and DFlash drafters (z-lab layout), local or from the Hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .compat import TargetShape, check_compatible  # noqa: F401  (re-exported)
from .drafter import DFlashDraftModel, ModelArgs
from .errors import DFlashError
from .hub import is_repo_id, snapshot
from .target import TargetModel

DRAFTER_PATTERNS = ["*.json", "*.safetensors"]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def resolve_path(path_or_repo: str | Path, allow_patterns: list[str] | None = None,
                 revision: str | None = None) -> Path:
    """A local directory as is; otherwise a Hub repo id through huggingface_hub's cache.

    Offline (HF_HUB_OFFLINE=1) only the local cache is consulted.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{path} is a file; expected a model directory")
        return path
    name = str(path_or_repo)
    if not is_repo_id(name):
        raise DFlashError(f"{name}: no such directory, and not a Hugging Face repo id (org/name)")
    return snapshot(name, allow_patterns=allow_patterns, revision=revision)


def default_dtype() -> mx.Dtype | None:
    """float32 on the CPU (MLX's CPU half-precision matmuls are slow); the checkpoint's otherwise."""
    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    return mx.float32


def cast_floats(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """Cast floating-point parameters (not packed quantized weights) to `dtype`."""
    if dtype is None:
        return
    model.update(tree_map(
        lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
        model.parameters(),
    ))


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


def build_drafter(config: dict[str, Any], where: str, num_target_layers: int | None = None) -> DFlashDraftModel:
    """The drafter a z-lab config describes (random weights), or one clear error."""
    if "dflash_config" not in config:
        raise DFlashError(f"{where}: config.json has no dflash_config; not a DFlash drafter")
    try:
        args = ModelArgs.from_dict(config)
    except TypeError as e:
        raise DFlashError(f"{where}: incomplete drafter config ({e})") from None
    if num_target_layers is not None:
        args.resolve_target_layers(num_target_layers)
    try:
        return DFlashDraftModel(args)
    except ValueError as e:
        raise DFlashError(f"{where}: {e}") from None


def load_checked(model: nn.Module, weights: dict[str, mx.array], where: str) -> None:
    """Load `weights` into `model`, refusing missing, unexpected or misshapen tensors."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DFlashError(
            f"{where}: weights do not match the config"
            + (f"; missing {', '.join(missing[:4])}" if missing else "")
            + (f"; unexpected {', '.join(unexpected[:4])}" if unexpected else "")
        )
    for key, value in expected.items():
        if weights[key].shape != value.shape:
            raise DFlashError(
                f"{where}: weight {key} has shape {tuple(weights[key].shape)}, the config implies {tuple(value.shape)}"
            )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())


def load_drafter(
    path_or_repo: str | Path,
    target: TargetModel | None = None,
    *,
    dtype: mx.Dtype | None = None,
    revision: str | None = None,
) -> DFlashDraftModel:
    """Load a z-lab DFlash v1 drafter; every checkpoint key and shape is checked."""
    path = resolve_path(path_or_repo, DRAFTER_PATTERNS, revision)
    config = _read_json(path / "config.json")
    model = build_drafter(config, str(path), target.num_layers if target is not None else None)
    weights = model.sanitize(read_safetensors(path))
    if model.args.quantization:
        q = model.args.quantization
        nn.quantize(
            model, group_size=q["group_size"], bits=q["bits"],
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights,
        )
    load_checked(model, weights, str(path))
    cast_floats(model, dtype)
    model.eval()
    mx.eval(model.parameters())
    if target is not None:
        check_compatible(model, target)
    return model


def load_target(path_or_repo: str | Path, *, dtype: mx.Dtype | None = None,
                revision: str | None = None) -> tuple[nn.Module, Any]:
    """An mlx-lm model and tokenizer, cast to `dtype` (float32 on the CPU by default)."""
    from mlx_lm.utils import load as mlx_lm_load

    from .resolve import target_source

    # Short names, .gguf files and PyTorch-only checkpoints go through the converted cache.
    path = resolve_path(path_or_repo, None, revision) if revision else target_source(path_or_repo)
    if not (path / "config.json").exists():
        raise DFlashError(f"{path}: missing config.json")
    from mlx_dflash.convert.config import rope_overrides

    try:
        # transformers-5 configs nest rope_theta; mlx-lm would silently use base 10000.
        model, tokenizer = mlx_lm_load(str(path), model_config=rope_overrides(_read_json(path / "config.json")))
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        # One line, but whole: mlx-lm puts the names of missing weights on the next line.
        raise DFlashError(f"{path}: cannot load target ({' '.join(str(e).split())})") from e
    TargetModel(model)  # fails early, naming the supported families
    cast_floats(model, dtype)
    return model, tokenizer


def load(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    dtype: str | None = None,
) -> tuple[nn.Module, Any, DFlashDraftModel | None]:
    """Load a target (mlx-lm format) and optionally its DFlash drafter.

    Each may be a directory, a Hub repo id or a known short name (`Qwen3-8B`, see
    `mlx_dflash.resolve.KNOWN_PAIRS`); a target may also be a .gguf file or a
    PyTorch-only checkpoint, converted once into the converted-weights cache.

    Returns (model, tokenizer, draft_model) ready for `generate`/`stream_generate`.
    `dtype` is one of float32/float16/bfloat16; default float32 on the CPU.
    """
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    mx_dtype = DTYPES[dtype] if dtype else default_dtype()
    target_model, tokenizer = load_target(model, dtype=mx_dtype)
    drafter = None
    if draft is not None:
        target = TargetModel(target_model)
        from .resolve import drafter_source

        drafter = load_drafter(drafter_source(draft), target, dtype=mx_dtype or target.dtype)
    return target_model, tokenizer, drafter
