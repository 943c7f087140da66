"""Linux CPU setup that must run before `mlx.core` is first imported.

The `mlx-cpu` wheel bundles the reference (netlib) BLAS, about 25x slower than
OpenBLAS for fp32 matmuls; loading the system OpenBLAS globally first makes MLX
resolve its BLAS symbols there. Opt out with MLX_DFLASH_NO_OPENBLAS=1.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from pathlib import Path

OPT_OUT_ENV = "MLX_DFLASH_NO_OPENBLAS"
_CANDIDATES = ("libopenblas.so.0", "libopenblas.so")

openblas_loaded = False


def _load_openblas() -> bool:
    names = list(_CANDIDATES)
    found = ctypes.util.find_library("openblas")
    if found:
        names.insert(0, found)
    for name in names:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


def setup() -> None:
    """Preload OpenBLAS on Linux (once), or say once how to get it."""
    global openblas_loaded
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT_ENV):
        return
    if "mlx.core" in sys.modules:
        # Too late to interpose: MLX already bound its BLAS symbols.
        return
    openblas_loaded = _load_openblas()
    if not openblas_loaded:
        warnings.warn(
            "OpenBLAS not found: MLX will use its bundled reference BLAS, which makes "
            "fp32 matmuls ~25x slower on the CPU. Install it with "
            "`apt-get install libopenblas0-pthread` (set "
            f"{OPT_OUT_ENV}=1 to silence this).",
            RuntimeWarning,
            stacklevel=2,
        )


def machine() -> str:
    """The CPU (or Apple chip) and OS, as people name them."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or name
        except (OSError, subprocess.SubprocessError):
            pass
    import mlx.core as mx

    device = "GPU" if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()) else "CPU"
    return f"{name}, {platform.system()} {platform.machine()}, MLX {mx.__version__} on the {device}"
