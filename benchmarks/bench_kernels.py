"""The injection kernels: graph size everywhere, draft-step time with and without them on a Mac.

    python benchmarks/bench_kernels.py               # Qwen3-4B-DFlash shapes, bf16, random weights
    python benchmarks/bench_kernels.py --small       # a smaller drafter (quicker)
    python benchmarks/bench_kernels.py --count-only  # only the graph counts (any machine)

Part 1 counts the primitives in MLX's graph (mx.export_to_dot) of the pure-MLX
work each kernel replaces (one context injection; the block Q/K preparation of
one draft layer) and of a whole draft step. On the CPU backend mx.fast.rms_norm
and mx.fast.rope are built from their fallbacks, so the counts are larger than
on Metal, where each is one primitive. The kernel path replaces each of those
subgraphs with ONE launch by construction (it cannot run off-Mac).
Part 2 (Metal only) times one context injection and one draft step at a few
context lengths, kernels on versus MLX_DFLASH_NO_KERNELS=1.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import io
import os
import platform
import re
import statistics
import time
from collections import Counter

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx.core on Linux)
import mlx.core as mx
from mlx.utils import tree_map

from mlx_dflash import kernels
from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs
from mlx_dflash.drafters.injection import ContextInjector, inject_context_kv_reference

# Primitives that only re-describe memory: no launch unless a later op needs a copy.
VIEWS = {"Reshape", "Transpose", "Slice", "Broadcast", "ExpandDims", "Squeeze", "AsStrided", "Flatten",
         "Unflatten", "StopGradient"}

QWEN3_4B = dict(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, num_hidden_layers=5)
SMALL = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             intermediate_size=2816, num_hidden_layers=5)


def count_primitives(*outputs: mx.array) -> Counter:
    """Primitive name -> number of nodes in the graph that computes `outputs` from evaluated leaves."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return Counter(re.findall(r'label ="(\w+)", shape=rectangle', dot.getvalue()))


def summary(counts: Counter) -> str:
    compute = sum(v for k, v in counts.items() if k not in VIEWS)
    views = sum(v for k, v in counts.items() if k in VIEWS)
    top = ", ".join(f"{k} {v}" for k, v in counts.most_common(6))
    return f"{compute} compute + {views} view primitives ({top})"


def make_drafter(shape: dict, dtype: mx.Dtype, block_size: int = 16) -> DFlashDraftModel:
    args = ModelArgs.from_dict({
        **shape, "vocab_size": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "block_size": block_size,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 9, 17, 25, 33]},
    })
    model = DFlashDraftModel(args)
    model.update(tree_map(lambda p: (0.02 * mx.random.normal(p.shape)).astype(dtype) if p.ndim > 1
                          else mx.ones(p.shape, dtype=dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def block_qk_pure(attn, x: mx.array, rope, position: int) -> tuple[mx.array, mx.array]:
    """The pure-MLX block Q/K preparation of Attention.__call__, from evaluated projections."""
    B, L, _ = x.shape
    qp, kp = attn.q_proj(x), attn.k_proj(x)
    mx.eval(qp, kp)
    q = attn.q_norm(qp.reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    k = attn.k_norm(kp.reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    return rope(q, offset=position), rope(k, offset=position)


def setup(drafter: DFlashDraftModel, context: int, dtype: mx.Dtype):
    a = drafter.args
    cache = DraftContextCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim,
                              max_block_size=a.block_size, dtype=dtype)
    injector = ContextInjector(drafter)
    features = len(drafter.target_layer_ids) * a.hidden_size
    injector(mx.random.normal((1, context, features)).astype(dtype), 0, cache)
    mx.eval(cache.state_arrays())
    return cache, injector, features


def part1(drafter: DFlashDraftModel, dtype: mx.Dtype) -> None:
    a = drafter.args
    print("Part 1: primitives in the pure-MLX graph (this backend:", "Metal" if mx.metal.is_available() else "CPU",
          "- fast.rms_norm/rope decompose on the CPU)")
    n = 8
    kv = drafter.layers[0].self_attn.k_proj.weight  # any evaluated array, for its dtype
    kv = mx.random.normal((1, n, a.num_hidden_layers, 2, a.num_key_value_heads, a.head_dim)).astype(kv.dtype)
    injector = ContextInjector(drafter)
    mx.eval(kv, injector.k_norm_weight)
    keys, values = inject_context_kv_reference(kv=kv, k_norm_weight=injector.k_norm_weight, eps=injector.eps,
                                               rope=drafter.rope, offset=1000, dtype=dtype)
    per_layer_writes = 2 * a.num_hidden_layers
    print(f"  context injection of {n} positions, norm+RoPE+casts+layout: {summary(count_primitives(keys, values))}")
    print(f"    kernel path: 1 launch (then the same {per_layer_writes} per-layer cache slice writes)")
    x = mx.random.normal((1, a.block_size, a.hidden_size)).astype(dtype)
    mx.eval(x)
    q, k = block_qk_pure(drafter.layers[0].self_attn, x, drafter.rope, 1000)
    print(f"  block Q/K preparation, one layer: {summary(count_primitives(q, k))}")
    print(f"    kernel path: 1 launch per layer, {a.num_hidden_layers} per draft step")
    cache, _, _ = setup(drafter, 64, dtype)
    out = drafter(x, cache, cache.offset)
    print(f"  whole draft step ({a.num_hidden_layers} layers): {summary(count_primitives(out))}")


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def measure(drafter: DFlashDraftModel, dtype: mx.Dtype, context: int, iters: int) -> list[tuple[float, float]]:
    """(inject, draft step) milliseconds with kernels, then with MLX_DFLASH_NO_KERNELS=1."""
    a = drafter.args
    cache, injector, features = setup(drafter, context, dtype)
    hidden = mx.random.normal((1, 8, features)).astype(dtype)
    block = mx.random.normal((1, a.block_size, a.hidden_size)).astype(dtype)
    mx.eval(hidden, block)

    def inject():
        injector(hidden, cache.offset, cache)
        mx.eval(cache.state_arrays())
        cache.trim(hidden.shape[1])

    def draft():
        mx.eval(drafter(block, cache, cache.offset - 1))

    rows = []
    for kill in (False, True):
        if kill:
            os.environ[kernels.KILL_SWITCH_ENV] = "1"
        else:
            os.environ.pop(kernels.KILL_SWITCH_ENV, None)
        rows.append((timed(inject, iters), timed(draft, iters)))
    os.environ.pop(kernels.KILL_SWITCH_ENV, None)
    return rows


def part2(drafter: DFlashDraftModel, dtype: mx.Dtype, contexts: list[int], iters: int) -> None:
    print("Part 2: milliseconds (median), kernels on / off")
    for context in contexts:
        (ik, dk), (ip, dp) = measure(drafter, dtype, context, iters)
        print(f"  context {context:>6}: inject 8 positions {ik:7.3f} / {ip:7.3f}   draft step {dk:7.3f} / {dp:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a smaller drafter than Qwen3-4B-DFlash")
    parser.add_argument("--count-only", action="store_true", help="only the graph counts")
    parser.add_argument("--contexts", default="512,4096,32768", help="context lengths for part 2")
    parser.add_argument("--iters", type=int, default=20)
    opts = parser.parse_args()
    dtype = mx.bfloat16 if mx.metal.is_available() else mx.float32  # bf16 matmuls are slow on the CPU
    drafter = make_drafter(SMALL if opts.small else QWEN3_4B, dtype)
    print(f"{platform.platform()}, MLX {mx.__version__}, kernel backend: {kernels.backend() or 'none'}, {dtype}")
    part1(drafter, dtype)
    if opts.count_only:
        return
    if kernels.backend() is None:
        print("Part 2 skipped: the kernels run on Metal (Apple silicon) only; unset MLX_DFLASH_NO_KERNELS there.")
        return
    part2(drafter, dtype, [int(c) for c in opts.contexts.split(",")], opts.iters)


if __name__ == "__main__":
    main()
