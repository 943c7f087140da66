"""Custom kernels for the drafter's K/V injection (Metal; CUDA twin opt-in).

- context_kv: every draft layer's context k_norm + RoPE + casts + cache layout, one launch per injection.
- block_qk: one draft layer's block q_norm + k_norm + RoPE + attention layout, one launch.

Selection: `backend()` is 'metal' when `mx.metal.is_available()`, unless
MLX_DFLASH_NO_KERNELS is set; elsewhere callers keep their pure-MLX path, which
stays the reference. Where each path is exercised: the Metal kernels run only on
Apple silicon (tests/test_kernels_metal.py, benchmarks/bench_kernels.py); their
source is run thread by thread on any CPU by tests/emulate_metal.py in CI; the
CUDA twin (MLX_DFLASH_CUDA_KERNELS=1) shares the body but is unverified until
tests/test_kernels_metal.py runs on an NVIDIA device.
"""

from ._common import CUDA_OPT_IN_ENV, KILL_SWITCH_ENV, backend
from .block_qk import prepare_block_qk
from .context_kv import inject_context_kv
from .rope_tables import RopeTables, rope_tables

__all__ = [
    "CUDA_OPT_IN_ENV",
    "KILL_SWITCH_ENV",
    "RopeTables",
    "backend",
    "inject_context_kv",
    "prepare_block_qk",
    "rope_tables",
]
