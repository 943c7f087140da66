"""Custom kernels for the drafter's K/V injection (Metal; CUDA twin opt-in).

- context_kv: every draft layer's context k_norm + RoPE + casts + cache layout, one launch per injection.
- block_qk: one draft layer's block q_norm + k_norm + RoPE + attention layout, one launch.

Selection: `backend()` is 'metal' when `mx.metal.is_available()`, unless
MLX_DFLASH_KERNELS=off (or MLX_DFLASH_NO_KERNELS) is set; elsewhere callers keep
their pure-MLX path, which stays the reference. With MLX_DFLASH_KERNELS=auto (the
default) each kernel is checked against its pure-MLX twin on first use and falls
back to it if it fails (`self_check`); =on skips the check. Where each path is exercised: the Metal kernels run only on
Apple silicon (tests/kernels/test_kernels_metal.py, benchmarks/bench_kernels.py); their
source is run thread by thread on any CPU by tests/helpers/emulate_metal.py in CI; the
CUDA twin (MLX_DFLASH_CUDA_KERNELS=1) shares the body but is unverified until
tests/kernels/test_kernels_metal.py runs on an NVIDIA device.
"""

from . import self_check
from ._common import CUDA_OPT_IN_ENV, KILL_SWITCH_ENV, MODE_ENV, backend, mode
from .block_qk import block_qk_reference, prepare_block_qk
from .context_kv import context_kv_reference, inject_context_kv
from .rope_tables import RopeTables, rope_tables

__all__ = [
    "CUDA_OPT_IN_ENV",
    "KILL_SWITCH_ENV",
    "MODE_ENV",
    "RopeTables",
    "backend",
    "block_qk_reference",
    "context_kv_reference",
    "inject_context_kv",
    "mode",
    "prepare_block_qk",
    "rope_tables",
    "self_check",
]
