"""Each custom kernel checks itself against its pure-MLX twin the first time it runs.

The kernels were written without the hardware they run on, so the first call per
(kernel, backend, dtypes, head_dim) in a process runs the kernel and its reference on a
small input. A compile error, an exception or a difference beyond the output dtype's
tolerance switches that kernel to its reference for the rest of the process, with one
warning line saying which kernel, on which device and MLX, and what went wrong.
`MLX_DFLASH_KERNELS=on` skips the check; `off` never launches a kernel (`_common.mode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mlx.core as mx

from . import _common

logger = logging.getLogger("mlx_dflash")

# max |kernel - reference| / (1 + |reference|): a few units in the last place of the output
# dtype (both sides compute in float32 and round once); a wrong index or formula is O(1) off.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4 * 2.0**-10, mx.bfloat16: 4 * 2.0**-7}

Trial = Callable[[], tuple[list[mx.array], list[mx.array]]]


@dataclass(frozen=True)
class CheckResult:
    kernel: str
    backend: str
    dtype: str
    head_dim: int
    passed: bool
    max_error: float | None = None
    tolerance: float = 0.0
    error: str | None = None  # what went wrong, in one line

    def as_dict(self) -> dict:
        return asdict(self)


_RESULTS: dict[tuple[str, str, str, int], CheckResult] = {}


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def device_name() -> str:
    """What MLX calls this machine's device (e.g. 'Apple M2 Max'), for reports."""
    try:
        return str(mx.device_info().get("device_name", "unknown device"))
    except Exception:  # noqa: BLE001 - a report must not fail on an old MLX
        return "unknown device"


def run_check(kernel: str, backend: str, dtype: mx.Dtype, head_dim: int, trial: Trial) -> CheckResult:
    """Run `trial` (kernel outputs, reference outputs on one small input) and judge it."""
    tolerance = TOLERANCE.get(dtype, TOLERANCE[mx.float32])
    common = dict(kernel=kernel, backend=backend, dtype=_dtype_name(dtype), head_dim=head_dim, tolerance=tolerance)
    try:
        got, want = trial()
        mx.eval(got, want)
        worst = 0.0
        for g, w in zip(got, want, strict=True):
            if g.shape != w.shape or g.dtype != w.dtype:
                return CheckResult(**common, passed=False,
                                   error=f"output {g.shape} {g.dtype} where the reference gives {w.shape} {w.dtype}")
            w32 = w.astype(mx.float32)
            error = (mx.abs(g.astype(mx.float32) - w32) / (1.0 + mx.abs(w32))).max().item()
            if error != error or error > worst:  # a NaN sticks: nothing compares above it
                worst = error
    except Exception as e:  # noqa: BLE001 - a kernel that fails in any way falls back
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        return CheckResult(**common, passed=False, error=f"{type(e).__name__}: {first_line}")
    if not worst <= tolerance:  # also catches NaN
        return CheckResult(**common, passed=False, max_error=worst,
                           error=f"max error {worst:.3g} against the reference (tolerance {tolerance:.3g})")
    return CheckResult(**common, passed=True, max_error=worst)


def usable(kernel: str, backend: str, dtype: mx.Dtype, head_dim: int, trial: Trial) -> bool:
    """Whether to launch `kernel`: checked once per class, unless MLX_DFLASH_KERNELS=on."""
    if _common.mode() == "on":
        return True
    key = (kernel, backend, _dtype_name(dtype), head_dim)
    result = _RESULTS.get(key)
    if result is None:
        result = _RESULTS[key] = run_check(kernel, backend, dtype, head_dim, trial)
        if not result.passed:
            logger.warning(
                "mlx-dflash: kernel %s (%s, %s, head_dim %d) failed its self-check on %s with MLX %s: %s; "
                "using the pure-MLX path for the rest of this process (%s=off skips the kernels)",
                kernel, backend, result.dtype, head_dim, device_name(), mx.__version__, result.error,
                _common.MODE_ENV,
            )
    return result.passed


def results() -> list[CheckResult]:
    """Every check this process has run, in order."""
    return list(_RESULTS.values())


def forget() -> None:
    """Drop every result (tests; a kernel is checked again on its next use)."""
    _RESULTS.clear()


def small_normal(shape: tuple[int, ...], dtype: mx.Dtype, seed: int, scale: float = 1.0,
                 shift: float = 0.0) -> mx.array:
    """A fixed random input that leaves MLX's global generator alone (seeded runs stay seeded)."""
    return (shift + scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)
