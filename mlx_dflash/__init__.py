"""mlx-dflash: DFlash block-diffusion speculative decoding for MLX."""

from ._platform import setup as _setup_platform

_setup_platform()  # must precede the first `import mlx.core` (Linux OpenBLAS)

from .drafter import DFlashDraftModel, ModelArgs  # noqa: E402
from .drafter2 import DFlash2DraftModel  # noqa: E402
from .errors import DFlashError, IncompatibleDrafterError  # noqa: E402
from .generate import GenerationEvent, GenerationStats, generate, stream_generate  # noqa: E402
from .loading import check_compatible, load, load_drafter  # noqa: E402
from .target import TargetModel, supported_model_types  # noqa: E402

__version__ = "0.1.0"

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
