"""Training DFlash drafters in MLX: data, anchors, the training forward, loss, loop, export."""

from .export import export_drafter
from .trainer import TrainConfig, Trainer, TrainEvent, TrainResult

__all__ = ["TrainConfig", "TrainEvent", "TrainResult", "Trainer", "export_drafter"]
