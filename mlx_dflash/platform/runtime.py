"""The runtime setup mlx-lm's generate and server use on a Mac, and what threads must respect.

- `generation_stream`: decoding runs on its own stream of the default device, as mlx-lm's
  `generate_step` does. Since MLX 0.31.2 a stream belongs to the thread that made it, so
  this is a thread-local stream (each thread that decodes gets its own), as in mlx-lm.
- `wired_limit`: while decoding, the recommended working set is wired (macOS 15+), so the
  weights are not paged out between cycles; a model near that size gets one warning.
  Devices that report no recommended size (CPU, CUDA) are left alone.
- `settle`: an array whose lazy graph was built on one thread cannot be evaluated on
  another ("There is no Stream(gpu, N) in current thread"), so everything a worker thread
  will read (lazily loaded weights, rope frequencies, cached sessions) is evaluated first,
  on the thread that built it.
- `default_prompt_cache_bytes`: the server's prompt cache sized from what the device reports.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

logger = logging.getLogger("mlx_dflash")

# MLX before 0.31.2 shares streams between threads and has no thread-local ones.
_new_stream = getattr(mx, "new_thread_local_stream", mx.new_stream)
generation_stream = _new_stream(mx.default_device())

NEAR_WORKING_SET = 0.9  # mlx-lm's threshold for its "close to the maximum recommended size" warning
PROMPT_CACHE_SHARE = 0.25  # of the memory the models leave free
PROMPT_CACHE_MIN = 256 << 20
PROMPT_CACHE_MAX = 16 << 30


def arrays_of(*trees: Any) -> list[mx.array]:
    """Every array in modules, lists and dicts, private entries included (rope `_freqs`)."""
    return [x for tree in trees if tree is not None for _, x in tree_flatten(tree) if isinstance(x, mx.array)]


def model_bytes(*models: Any) -> int:
    return sum(a.nbytes for a in arrays_of(*models))


def settle(*trees: Any) -> None:
    """Evaluate every array reachable from `trees` on this thread (before another thread reads them)."""
    mx.eval(arrays_of(*trees))


def device_memory() -> tuple[int | None, int | None]:
    """(memory the device may use well, total memory) in bytes, as MLX or the OS reports them.

    On a Mac, MLX reports the recommended working set of the GPU; elsewhere the physical memory
    stands for both. None where nothing is known.
    """
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - an MLX without device_info
        info = {}
    total = info.get("memory_size")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
    return info.get("max_recommended_working_set_size", total), total


def default_prompt_cache_bytes(*models: Any) -> int:
    """A quarter of the memory the models leave free, between 256 MiB and 16 GiB."""
    usable, _ = device_memory()
    if usable is None:
        return 4 << 30
    free = max(usable - model_bytes(*models), 0)
    return int(min(max(PROMPT_CACHE_SHARE * free, PROMPT_CACHE_MIN), PROMPT_CACHE_MAX))


def default_batch_bytes(prompt_cache_bytes: int, *models: Any) -> int:
    """Half the memory the models and the prompt cache leave free, at least 256 MiB (batched K/V caches)."""
    usable, _ = device_memory()
    if usable is None:
        return 4 << 30
    return int(max(0.5 * (usable - model_bytes(*models) - prompt_cache_bytes), PROMPT_CACHE_MIN))


@contextmanager
def buffer_cache_limit(limit: int) -> Iterator[None]:
    """Keep at most `limit` bytes of freed buffers for reuse while inside, then restore the old limit.

    MLX keeps every freed buffer by default (up to its memory limit): a server whose requests come
    and go would hold memory no budget counts. A small cache still serves a cycle's recurring shapes.
    """
    old = mx.set_cache_limit(limit)
    try:
        yield
    finally:
        mx.set_cache_limit(old)


@contextmanager
def wired_limit(models: Iterable[Any]) -> Iterator[None]:
    """Wire the device's recommended working set while decoding (what mlx-lm does), then restore.

    A no-op where the device reports no recommended size. Pending work on this thread's
    generation stream is waited for before the limit changes back.
    """
    try:
        recommended = mx.device_info().get("max_recommended_working_set_size")
    except Exception:  # noqa: BLE001 - an MLX without device_info
        recommended = None
    if not recommended:
        yield
        return
    size = model_bytes(*models)
    if size > NEAR_WORKING_SET * recommended:
        logger.warning("mlx-dflash: the models take %d MB, close to this Mac's recommended working set of %d MB; "
                       "decoding may be slow (a smaller quantization, or raising iogpu.wired_limit_mb, helps)",
                       size >> 20, recommended >> 20)
    old = mx.set_wired_limit(recommended)
    try:
        yield
    finally:
        mx.synchronize(generation_stream)
        mx.set_wired_limit(old)
