"""Reading checkpoint weights: safetensors (single or sharded) and PyTorch state dicts.

PyTorch files are read with `weights_only=True`: a pickle that needs code to
run is refused, never executed. torch is imported only when such a file is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlx_dflash.errors import DFlashError

from .progress import ProgressFn, no_progress

TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors if any, else PyTorch files."""
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return _check_index(directory, files, "model.safetensors.index.json")
    files = sorted(p for p in directory.iterdir() if p.suffix in TORCH_SUFFIXES and p.is_file())
    if files:
        return _check_index(directory, files, "pytorch_model.bin.index.json")
    raise DFlashError(f"{directory}: no weight files (*.safetensors, *.bin, *.pt)")


def _check_index(directory: Path, files: list[Path], index_name: str) -> list[Path]:
    index = directory / index_name
    if not index.is_file():
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DFlashError(f"{index}: not a valid shard index ({e})") from None
    missing = sorted({name for name in weight_map.values() if not (directory / name).is_file()})
    if missing:
        raise DFlashError(f"{directory}: shard index lists missing files {', '.join(missing[:3])}")
    return [directory / name for name in sorted(set(weight_map.values()))]


def read_weights(directory: Path, progress: ProgressFn = no_progress) -> dict[str, mx.array]:
    files = weight_files(directory)
    weights: dict[str, mx.array] = {}
    for i, f in enumerate(files):
        progress("read", i, len(files))
        part = _read_torch(f) if f.suffix in TORCH_SUFFIXES else _read_safetensors(f)
        weights.update(part)
    progress("read", len(files), len(files))
    return weights


def _read_safetensors(path: Path) -> dict[str, mx.array]:
    try:
        weights = mx.load(str(path))
        mx.eval(list(weights.values()))  # force the read so truncation shows up here
    except Exception as e:  # MLX raises plain RuntimeError/ValueError on bad files
        raise DFlashError(f"{path}: corrupt or truncated safetensors ({str(e).strip().splitlines()[0]})") from None
    return weights


def _read_torch(path: Path) -> dict[str, mx.array]:
    try:
        import torch
    except ImportError:
        raise DFlashError(
            f"{path.name} is a PyTorch checkpoint; reading it needs torch: pip install 'mlx-dflash[torch]'"
        ) from None
    import pickle

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        raise DFlashError(
            f"{path}: refused, the pickle needs code execution to load (only plain tensors are read safely; "
            f"{str(e).splitlines()[0][:120]})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise DFlashError(f"{path}: not a readable PyTorch checkpoint ({str(e).splitlines()[0]})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DFlashError(f"{path}: expected a state dict of tensors")
    out = {}
    for key, t in state.items():
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            out[key] = mx.array(t.float().numpy()).astype(mx.bfloat16)
        else:
            out[key] = mx.array(t.numpy())
    return out
