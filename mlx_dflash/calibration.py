"""The documented path of `calibrate` (README: Python API; docs/auto.md): calibration lives in
`mlx_dflash.auto.calibration`; this module only re-exports it."""

from .auto.calibration import Calibration, calibrate, measure

__all__ = ["Calibration", "calibrate", "measure"]
