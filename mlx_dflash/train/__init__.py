"""Training DFlash drafters: data, anchors, the training forward, loss, loop, export.

MLX is the default backend (`Trainer`); `torch_trainer` trains the same drafter
with PyTorch on CUDA machines. The MLX names are imported on first use, so the
framework-free modules import without MLX.
"""

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {"export_drafter": "export", "TrainConfig": "trainer", "Trainer": "trainer", "TrainEvent": "trainer",
            "TrainResult": "trainer"}

__all__ = ["TrainConfig", "TrainEvent", "TrainResult", "Trainer", "export_drafter"]

if TYPE_CHECKING:
    from .export import export_drafter
    from .trainer import TrainConfig, Trainer, TrainEvent, TrainResult


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlx_dflash.train' has no attribute '{name}'")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
