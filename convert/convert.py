"""`convert`: a checkpoint (directory or .gguf file) -> an MLX directory, written atomically."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dflash.drafters.pairing import TargetShape, check_compatible
from mlx_dflash.errors import DFlashError
from mlx_dflash.targets.dtypes import DTYPES, cast_floats

from . import build, gguf, gguf_tokenizer
from .build import build_drafter, load_checked
from .config import is_drafter, normalise_config, read_config
from .progress import ProgressFn, no_progress
from .quantize import check_quant_options, match_packed, packed_layers, quantize, unpack
from .readers import read_weights
from .writer import atomic_directory, check_destination

CONVERTER = "mlx-dflash convert 1"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class ConvertOptions:
    """What the output looks like; also the converted-cache key (with the source)."""

    dtype: str | None = None  # None: keep the checkpoint's float dtypes
    quantize: bool = False
    q_bits: int = 4
    q_group_size: int = 64
    q_recipe: str = "mixed"
    # Store packed (GGUF / quantized) weights as plain floats: MLX's CPU quantized matmuls
    # are several times slower than OpenBLAS for a multi-token verify.
    dequantize: bool = False

    def validate(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise DFlashError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        if self.dequantize and self.quantize:
            raise DFlashError("--dequantize and --quantize exclude each other")
        if self.quantize:
            check_quant_options(self.q_bits, self.q_group_size, self.q_recipe)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.quantize:  # quantization settings do not matter when not quantizing
            for k in ("q_bits", "q_group_size", "q_recipe"):
                d.pop(k)
        if not self.dequantize:  # keeps the cache keys of earlier conversions
            d.pop("dequantize")
        return d


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    kind: str  # "target" or "drafter"
    config: dict[str, Any]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(
    src: str | Path,
    dst: str | Path,
    options: ConvertOptions = ConvertOptions(),
    *,
    force: bool = False,
    target: str | Path | TargetShape | None = None,
    provenance: dict[str, Any] | None = None,
    progress: ProgressFn = no_progress,
) -> ConvertResult:
    """Convert a local checkpoint directory or .gguf file at `src` into an MLX directory at `dst`.

    A DFlash drafter is recognised by its config. `target` (a directory or a
    `TargetShape`) makes a drafter conversion check the pair first. Nothing is
    left at `dst` unless the whole conversion succeeds.
    """
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    options.validate()
    check_destination(dst, force)
    if not src.exists():
        raise DFlashError(f"{src}: no such file or directory")
    info = dict(provenance or {"source": str(src.absolute())})
    info.setdefault("options", options.as_dict())
    info.setdefault("converter", CONVERTER)
    if src.is_file():
        if src.suffix != ".gguf":
            raise DFlashError(f"{src}: expected a model directory or a .gguf file")
        info.setdefault("sha256", file_sha256(src))
        return _convert_gguf(src, dst, options, force, info, progress)
    config = read_config(src)
    if is_drafter(config):
        return _convert_drafter(src, dst, config, options, force, target, info, progress)
    if target is not None:
        raise DFlashError(f"{src} is a target model; --target applies only to drafter conversions")
    return _convert_target(src, dst, config, options, force, info, progress)


def _target_from(config: dict[str, Any], read: Any, options: ConvertOptions, info: dict[str, Any], where: str,
                 progress: ProgressFn) -> nn.Module:
    """Build the target `config` describes, load the weights `read()` returns (checked), cast or
    quantize per `options`, and record the quantization and provenance blocks in `config`."""
    model = build.target_model(config, where)
    weights = read()
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    weights, packed = _prepare_weights(weights, model, options)
    load_checked(model, weights, where)
    del weights
    quant = _finish(model, options, False, packed, progress)
    if quant:
        config["quantization"] = config["quantization_config"] = quant
    config["mlx_dflash"] = info
    return model


def _finish(model: nn.Module, options: ConvertOptions, drafter: bool, packed: dict[str, Any],
            progress: ProgressFn) -> dict[str, Any] | None:
    """Cast and quantize per `options`; returns the config quantization block."""
    if options.dtype:
        cast_floats(model, DTYPES[options.dtype])
    if options.quantize:
        return quantize(model, bits=options.q_bits, group_size=options.q_group_size,
                        recipe=options.q_recipe, drafter=drafter, progress=progress)
    return packed or None


def _prepare_weights(weights: dict[str, mx.array], model: nn.Module, options: ConvertOptions
                     ) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Packed source weights are unpacked to re-quantize, or else the model is given matching layers."""
    layers = packed_layers(weights)
    if not layers:
        return weights, {}
    if options.quantize or options.dequantize:
        return unpack(weights, DTYPES[options.dtype] if options.dtype else mx.float32), {}
    return weights, match_packed(model, layers)


def _write(dst: Path, force: bool, model: nn.Module, config: dict[str, Any], progress: ProgressFn,
           extra: Any = None) -> None:
    """Shards of at most ~5 GB plus the index mlx-lm reads (mlx-lm's own writer prints)."""
    from mlx_lm.utils import make_shards

    weights = dict(tree_flatten(model.parameters()))
    shards = make_shards(weights)
    total_bytes = sum(v.nbytes for v in weights.values())
    del weights
    with atomic_directory(dst, force) as tmp:
        weight_map = {}
        for i, shard in enumerate(shards):
            progress("write", i, len(shards))
            name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2, default=str))
        if extra is not None:
            extra(tmp)
        progress("write", len(shards), len(shards))


def _convert_target(src: Path, dst: Path, config: dict[str, Any], options: ConvertOptions, force: bool,
                    info: dict[str, Any], progress: ProgressFn) -> ConvertResult:
    config = normalise_config(config)
    model = _target_from(config, lambda: read_weights(src, progress), options, info, str(src), progress)

    def copy_tokenizer(tmp: Path) -> None:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)

    _write(dst, force, model, config, progress, copy_tokenizer)
    return ConvertResult(dst, "target", config)


def _target_shape(target: str | Path | TargetShape) -> TargetShape:
    if isinstance(target, TargetShape):
        return target
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        tensors, meta = gguf.read_tensors(path)
        return TargetShape.from_config(gguf.config_from_metadata(meta, tensors, str(path)), f"target {path.name}")
    return TargetShape.from_config(read_config(path), f"target {path.name}")


def _convert_drafter(src: Path, dst: Path, config: dict[str, Any], options: ConvertOptions, force: bool,
                     target: str | Path | TargetShape | None, info: dict[str, Any],
                     progress: ProgressFn) -> ConvertResult:
    config = normalise_config(config)
    shape = _target_shape(target) if target is not None else None
    model = build_drafter(config, str(src), shape.num_layers if shape else None)
    if shape is not None:
        check_compatible(model, shape, f"drafter {src.name}")
        config.setdefault("dflash_config", {})["target_layer_ids"] = model.target_layer_ids
    weights = model.sanitize(read_weights(src, progress))
    weights, packed = _prepare_weights(weights, model, options)
    load_checked(model, weights, str(src))
    del weights
    quant = _finish(model, options, True, packed, progress)
    if quant:
        # Our drafter loader quantizes the layers whose scales it finds, with these settings.
        config["quantization"] = quant
    config["mlx_dflash"] = info
    _write(dst, force, model, config, progress)
    return ConvertResult(dst, "drafter", config)


def _convert_gguf(src: Path, dst: Path, options: ConvertOptions, force: bool, info: dict[str, Any],
                  progress: ProgressFn) -> ConvertResult:
    progress("read", 0, 1)
    tensors, meta = gguf.read_tensors(src)
    config = gguf.config_from_metadata(meta, tensors, str(src))
    # Built before the weights are converted, so an unusable tokenizer fails in seconds.
    tokenizer, tokenizer_config = gguf_tokenizer.build_tokenizer(meta, str(src))
    pending = [gguf.hf_weights(tensors, config)]  # popped by the loader: no reference stays here
    del tensors
    progress("read", 1, 1)
    model = _target_from(config, pending.pop, options, info, str(src), progress)
    _write(dst, force, model, config, progress,
           lambda tmp: gguf_tokenizer.write_tokenizer(tokenizer, tokenizer_config, tmp))
    return ConvertResult(dst, "target", config)
