"""Checkpoint conversion: PyTorch, safetensors and GGUF checkpoints to MLX directories."""

try:
    from .convert import ConvertOptions, ConvertResult, convert, file_sha256
    from .progress import ProgressFn, no_progress
    from .quantize import BITS, GROUP_SIZES, RECIPES
except ModuleNotFoundError as e:  # the GGUF reader (`gguf`) also serves the PyTorch trainer, where MLX is absent
    if (e.name or "").split(".")[0] != "mlx":
        raise

__all__ = [
    "BITS", "GROUP_SIZES", "RECIPES", "ConvertOptions", "ConvertResult", "ProgressFn", "convert", "file_sha256",
    "no_progress",
]
