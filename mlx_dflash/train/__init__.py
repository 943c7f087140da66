"""Training DFlash drafters: data, anchors, the training forward, loss, loop, export.

MLX is the default backend (`Trainer`); `torch_trainer` trains the same drafter
with PyTorch on CUDA machines, where the MLX names below are absent.
"""

try:
    from .export import export_drafter
    from .trainer import TrainConfig, Trainer, TrainEvent, TrainResult
except ModuleNotFoundError as e:  # the framework-free modules and the PyTorch trainer import without MLX
    if (e.name or "").split(".")[0] != "mlx":
        raise

__all__ = ["TrainConfig", "TrainEvent", "TrainResult", "Trainer", "export_drafter"]
