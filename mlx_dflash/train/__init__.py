"""Training DFlash drafters: data, anchors, the training forward, loss, loop, export.

MLX is the default backend (`Trainer`); `torch_trainer` trains the same drafter
with PyTorch on CUDA machines. The MLX names are imported on first use, so the
framework-free modules import without MLX.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

_EXPORTS = {"export_drafter": "export", "TrainConfig": "trainer", "Trainer": "trainer", "TrainEvent": "trainer",
            "TrainResult": "trainer"}

__all__ = ["TrainConfig", "TrainEvent", "TrainResult", "Trainer", "export_drafter"]

if TYPE_CHECKING:
    from .export import export_drafter
    from .trainer import TrainConfig, Trainer, TrainEvent, TrainResult


__getattr__ = lazy_attributes(__name__, _EXPORTS, globals())
