"""mlx-dflash: DFlash block-diffusion speculative decoding for MLX.

The public names are imported on first use, so that the framework-free parts of
the package (training data, anchors, the PyTorch trainer) import on machines
that have PyTorch but no MLX.
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes
from ._platform import setup as _setup_platform

_setup_platform()  # must precede the first `import mlx.core` (Linux OpenBLAS)

__version__ = "0.1.0"

_EXPORTS = {
    "DFlash2DraftModel": "drafter2",
    "DFlashDraftModel": "drafter",
    "ModelArgs": "drafter",
    "DFlashError": "errors",
    "IncompatibleDrafterError": "errors",
    "GenerationEvent": "generate",
    "GenerationStats": "generate",
    "generate": "generate",
    "stream_generate": "generate",
    "check_compatible": "loading",
    "load": "loading",
    "load_drafter": "loading",
    "TargetModel": "target",
    "supported_model_types": "target",
}

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

if TYPE_CHECKING:
    from .drafter import DFlashDraftModel, ModelArgs
    from .drafter2 import DFlash2DraftModel
    from .errors import DFlashError, IncompatibleDrafterError
    from .generate import GenerationEvent, GenerationStats, generate, stream_generate
    from .loading import check_compatible, load, load_drafter
    from .target import TargetModel, supported_model_types


__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())
