"""mlx-dflash: DFlash block-diffusion speculative decoding for MLX."""

from ._platform import setup as _setup_platform

_setup_platform()  # must precede the first `import mlx.core` (Linux OpenBLAS)

__version__ = "0.1.0"

try:
    from .drafter import DFlashDraftModel, ModelArgs
    from .drafter2 import DFlash2DraftModel
    from .errors import DFlashError, IncompatibleDrafterError
    from .generate import GenerationEvent, GenerationStats, generate, stream_generate
    from .loading import check_compatible, load, load_drafter
    from .target import TargetModel, supported_model_types
except ModuleNotFoundError as e:  # the PyTorch trainer imports the framework-free modules where MLX is absent
    if (e.name or "").split(".")[0] != "mlx":
        raise

__all__ = [
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "DFlashError",
    "GenerationEvent",
    "GenerationStats",
    "IncompatibleDrafterError",
    "ModelArgs",
    "TargetModel",
    "check_compatible",
    "generate",
    "load",
    "load_drafter",
    "stream_generate",
    "supported_model_types",
]
