"""The real kernels on a device against the pure-MLX reference (Metal on a Mac; CUDA opt-in).

Skipped where the device is missing: the host emulation (test_kernels_emulated.py)
checks the same source everywhere. References run on the CPU stream, whose RoPE
uses the same frequency tables as the kernels, so fp32 differences are only the
device's cos/sin and summation order.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers.kernel_cases import (
    BLOCK_CASES,
    CONTEXT_CASES,
    EPS,
    F32,
    block_inputs,
    block_reference,
    check,
    context_inputs,
    f32,
    make_rope,
)
from helpers.tiny import tiny_drafter, tiny_target

from mlx_dflash import kernels
from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.injection import ContextInjector, inject_context_kv_reference
from mlx_dflash.kernels import _common

BACKENDS = [
    pytest.param("metal", marks=pytest.mark.skipif(
        not mx.metal.is_available(), reason="Metal kernels run only on Apple silicon (macOS); CI uses the emulation")),
    pytest.param("cuda", marks=pytest.mark.skipif(
        not mx.cuda.is_available(), reason="the CUDA twin needs an NVIDIA GPU and mlx[cuda12]")),
]


def on_cpu(fn, *args, **kwargs):
    with mx.stream(mx.cpu):
        out = fn(*args, **kwargs)
        mx.eval(out)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,n,layers,kv_heads,head_dim,offset,in_dtype,dtype,rope_name", CONTEXT_CASES)
def test_context_kv_on_device(backend, B, n, layers, kv_heads, head_dim, offset, in_dtype, dtype, rope_name):
    kv, weight = context_inputs(B, n, layers, kv_heads, head_dim, in_dtype)
    rope = make_rope(rope_name, head_dim)
    keys, values = kernels.inject_context_kv(
        kv=kv, k_norm_weight=weight, eps=EPS, tables=kernels.rope_tables(rope, head_dim), offset=offset,
        dtype=dtype, backend=backend,
    )
    kw = dict(eps=EPS, rope=rope, offset=offset)
    ref_k, ref_v = on_cpu(inject_context_kv_reference, kv=kv, k_norm_weight=weight, dtype=dtype, **kw)
    f32_k, _ = on_cpu(inject_context_kv_reference, kv=kv.astype(F32), k_norm_weight=weight.astype(F32), dtype=F32,
                      **kw)
    check(keys, ref_k, f32_k, dtype, in_dtype)
    assert np.array_equal(f32(values), f32(ref_v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,L,num_heads,num_kv_heads,head_dim,offset,dtype,rope_name", BLOCK_CASES)
def test_block_qk_on_device(backend, B, L, num_heads, num_kv_heads, head_dim, offset, dtype, rope_name):
    q, k, qw, kw = block_inputs(B, L, num_heads, num_kv_heads, head_dim, dtype)
    rope = make_rope(rope_name, head_dim)
    q_out, k_out = kernels.prepare_block_qk(
        q=q, k=k, q_norm_weight=qw, k_norm_weight=kw, q_eps=EPS, k_eps=EPS,
        tables=kernels.rope_tables(rope, head_dim), offset=offset, num_heads=num_heads, num_kv_heads=num_kv_heads,
        backend=backend,
    )
    ref_q, ref_k = on_cpu(block_reference, q, k, qw, kw, rope, offset, num_heads, num_kv_heads)
    f32_q, f32_k = on_cpu(block_reference, *(a.astype(F32) for a in (q, k, qw, kw)), rope, offset, num_heads,
                          num_kv_heads)
    check(q_out, ref_q, f32_q, dtype)
    check(k_out, ref_k, f32_k, dtype)


@pytest.mark.skipif(not mx.metal.is_available(), reason="the engine selects kernels only on Metal")
def test_engine_uses_kernels_and_matches_kill_switch(monkeypatch):
    """The engine's draft step on Metal launches the kernels and equals the pure path (fp32, 1e-5)."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    injector = ContextInjector(drafter)
    args = drafter.args
    rng = np.random.default_rng(5)
    features = len(drafter.target_layer_ids) * args.hidden_size
    chunks = [mx.array(rng.standard_normal((1, n, features)), dtype=F32) for n in (9, 3)]
    block = mx.array(rng.standard_normal((1, args.block_size, args.hidden_size)), dtype=F32)

    def draft_step():
        cache = DraftContextCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
                                  max_block_size=args.block_size)
        for chunk in chunks:
            injector(chunk, cache.offset, cache)
        assert cache.offset == 12
        # The block starts where the engine starts it: at the first position the cache does not hold.
        out = drafter(block, cache, cache.offset)
        context = [k[..., : cache.stored, :] for k in cache.keys + cache.values]
        mx.eval(out, context)
        return out, context

    launches = []
    real_compiled = _common.compiled

    def counted(spec, kind):
        launches.append((spec.name, kind))
        return real_compiled(spec, kind)

    monkeypatch.setattr(_common, "compiled", counted)
    monkeypatch.delenv(kernels.KILL_SWITCH_ENV, raising=False)
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    assert kernels.backend() == "metal"
    kernels.self_check.forget()
    with_kernels, kernel_context = draft_step()
    # Each kernel passed its self-check on this Mac (one launch each), then the kernels really ran:
    # two injections, then one block launch per draft layer.
    checks = kernels.self_check.results()
    kernels.self_check.forget()
    assert checks and all(c.passed for c in checks), checks
    assert launches == ([("dflash_context_kv", "metal")] * 3
                        + [("dflash_block_qk", "metal")] * (1 + args.num_hidden_layers))
    monkeypatch.setenv(kernels.KILL_SWITCH_ENV, "1")
    launches.clear()
    without, pure_context = draft_step()
    assert launches == []  # the kill switch keeps the pure path
    for got, want in zip(kernel_context, pure_context, strict=True):
        np.testing.assert_allclose(f32(got), f32(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(with_kernels), f32(without), rtol=1e-5, atol=1e-5)
