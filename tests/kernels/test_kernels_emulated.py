"""The injection kernels' Metal source, run on the CPU through tests/helpers/emulate_metal.py.

Each case replays the exact call the library makes (`launch_args`) through the
emulated kernel and compares with the pure-MLX reference: fp32 tightly; fp16 and
bf16 within one unit in the last place of the float32 reference cast once to the
dtype (what a float32-internal kernel must give) and loosely against the dtype
reference the engine runs without kernels.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers.emulate_metal import EmulatedKernel, compiler_available
from helpers.kernel_cases import (
    BLOCK_CASES,
    CONTEXT_CASES,
    EPS,
    F32,
    block_inputs,
    block_reference,
    check,
    close,
    context_inputs,
    f32,
    make_rope,
)
from helpers.tiny import tiny_drafter, tiny_target
from mlx_lm.models.rope_utils import initialize_rope

from mlx_dflash import kernels
from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.injection import ContextInjector, inject_context_kv_reference
from mlx_dflash.kernels import _common, block_qk, context_kv

pytestmark = pytest.mark.skipif(not compiler_available(), reason="g++ is needed to emulate the Metal kernels")


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("metal_emulation")


# ---------------------------------------------------------------- context K/V


def run_context(spec, build_dir, *, kv, weight, rope, offset, dtype):
    tables = kernels.rope_tables(rope, kv.shape[-1])
    args = context_kv.launch_args(kv=kv, k_norm_weight=weight, eps=EPS, tables=tables, offset=offset, dtype=dtype)
    return EmulatedKernel(spec, build_dir)(**args)


@pytest.mark.parametrize("B,n,layers,kv_heads,head_dim,offset,in_dtype,dtype,rope_name", CONTEXT_CASES)
def test_context_kv_matches_reference(build_dir, B, n, layers, kv_heads, head_dim, offset, in_dtype, dtype,
                                      rope_name):
    kv, weight = context_inputs(B, n, layers, kv_heads, head_dim, in_dtype)
    rope = make_rope(rope_name, head_dim)
    keys, values = run_context(context_kv.SPEC, build_dir, kv=kv, weight=weight, rope=rope, offset=offset,
                               dtype=dtype)
    ref_k, ref_v = inject_context_kv_reference(kv=kv, k_norm_weight=weight, eps=EPS, rope=rope, offset=offset,
                                               dtype=dtype)
    f32_k, f32_v = inject_context_kv_reference(kv=kv.astype(F32), k_norm_weight=weight.astype(F32), eps=EPS,
                                               rope=rope, offset=offset, dtype=F32)
    check(keys, ref_k, f32_k, dtype, in_dtype)
    # Values are only cast and laid out: exactly the reference's.
    assert values.dtype == dtype and np.array_equal(f32(values), f32(ref_v))


# ---------------------------------------------------------------- block Q/K


def run_block(spec, build_dir, *, q, k, qw, kw, rope, offset, num_heads, num_kv_heads):
    args = block_qk.launch_args(
        q=q, k=k, q_norm_weight=qw, k_norm_weight=kw, q_eps=EPS, k_eps=EPS,
        tables=kernels.rope_tables(rope, qw.shape[0]), offset=offset, num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )
    return EmulatedKernel(spec, build_dir)(**args)


@pytest.mark.parametrize("B,L,num_heads,num_kv_heads,head_dim,offset,dtype,rope_name", BLOCK_CASES)
def test_block_qk_matches_reference(build_dir, B, L, num_heads, num_kv_heads, head_dim, offset, dtype, rope_name):
    q, k, qw, kw = block_inputs(B, L, num_heads, num_kv_heads, head_dim, dtype)
    rope = make_rope(rope_name, head_dim)
    q_out, k_out = run_block(block_qk.SPEC, build_dir, q=q, k=k, qw=qw, kw=kw, rope=rope, offset=offset,
                             num_heads=num_heads, num_kv_heads=num_kv_heads)
    ref_q, ref_k = block_reference(q, k, qw, kw, rope, offset, num_heads, num_kv_heads)
    f32_q, f32_k = block_reference(*(a.astype(F32) for a in (q, k, qw, kw)), rope, offset, num_heads, num_kv_heads)
    check(q_out, ref_q, f32_q, dtype)
    check(k_out, ref_k, f32_k, dtype)


# ---------------------------------------------------------------- broken copies must fail

BROKEN = [
    # kernel, where, what, original text, broken text
    ("context", "source", "heads swapped", "* 2 * H + h) * D", "* 2 * H + (H - 1 - h)) * D"),
    ("context", "source", "values read from K", "kv[src + H * D + i]", "kv[src + i]"),
    ("context", "source", "last row never written", "if (row >= L * B * H * n)", "if (row + 1 >= L * B * H * n)"),
    ("block", "source", "positions reversed", "q_out + (size_t(b * HQ + h) * L + pos) * D",
     "q_out + (size_t(b * HQ + h) * L + (L - 1 - pos)) * D"),
    ("block", "source", "q weight on keys", "k_norm_weight, inv_freq, params[1]", "q_norm_weight, inv_freq, params[1]"),
    ("context", "header", "norm weight missing", " * static_cast<float>(weight[i + D / 2])", ""),
    ("context", "header", "rope sign", "a * c - b * s", "a * c + b * s"),
    ("block", "header", "rms without mean", "sum_sq / D + eps", "sum_sq + eps"),
]


@pytest.mark.parametrize("kernel,where,what,old,new", BROKEN, ids=[b[2] for b in BROKEN])
def test_broken_kernel_copy_fails(build_dir, kernel, where, what, old, new):
    spec = context_kv.SPEC if kernel == "context" else block_qk.SPEC
    text = getattr(spec, where)
    assert text.count(old) == 1, f"mutation target for '{what}' not found once"
    broken = dataclasses.replace(spec, name=spec.name + "_broken", **{where: text.replace(old, new)})
    rope = make_rope("default", 64)
    if kernel == "context":
        kv, weight = context_inputs(2, 5, 3, 2, 64, F32)
        for got_spec, expect in ((spec, True), (broken, False)):
            keys, values = run_context(got_spec, build_dir, kv=kv, weight=weight, rope=rope, offset=100, dtype=F32)
            ref_k, ref_v = inject_context_kv_reference(kv=kv, k_norm_weight=weight, eps=EPS, rope=rope, offset=100,
                                                       dtype=F32)
            ok = close(keys, ref_k, 1e-5, 1e-5) and close(values, ref_v, 1e-5, 1e-5)
            assert ok is expect, f"{got_spec.name}: expected {'pass' if expect else 'failure'}"
    else:
        q, k, qw, kw = block_inputs(2, 6, 4, 2, 64, F32)
        for got_spec, expect in ((spec, True), (broken, False)):
            q_out, k_out = run_block(got_spec, build_dir, q=q, k=k, qw=qw, kw=kw, rope=rope, offset=100,
                                     num_heads=4, num_kv_heads=2)
            ref_q, ref_k = block_reference(q, k, qw, kw, rope, 100, 4, 2)
            ok = close(q_out, ref_q, 1e-5, 1e-5) and close(k_out, ref_k, 1e-5, 1e-5)
            assert ok is expect, f"{got_spec.name}: expected {'pass' if expect else 'failure'}"


# ---------------------------------------------------------------- wired into the engine

def test_engine_kernel_path_matches_pure_path(build_dir, monkeypatch):
    """ContextInjector and Attention.__call__ on the (emulated) kernel path give the pure path's result."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    injector = ContextInjector(drafter)
    args = drafter.args
    rng = np.random.default_rng(3)
    features = len(drafter.target_layer_ids) * args.hidden_size
    chunks = [mx.array(rng.standard_normal((1, n, features)), dtype=F32) for n in (9, 3)]
    block = mx.array(rng.standard_normal((1, args.block_size, args.hidden_size)), dtype=F32)

    def draft_step():
        cache = DraftContextCache(args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
                                  max_block_size=args.block_size)
        offset = 0
        for chunk in chunks:
            injector(chunk, offset, cache)
            offset += chunk.shape[1]
        hidden = drafter(block, cache, offset - 1)
        context = [k[..., : cache.stored, :] for k in cache.keys + cache.values]
        mx.eval(hidden, context)
        return hidden, context

    assert kernels.backend() is None or mx.metal.is_available()
    pure_hidden, pure_context = draft_step()

    launches = []

    def emulated(spec, kind):
        launches.append(spec.name)
        return EmulatedKernel(spec, build_dir)

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.setattr(_common, "compiled", emulated)
    monkeypatch.delenv(kernels.MODE_ENV, raising=False)
    kernels.self_check.forget()
    kernel_hidden, kernel_context = draft_step()
    kernels.self_check.forget()

    # Each kernel's self-check launch on first use, then two injections and one block launch per layer.
    assert launches == ["dflash_context_kv"] * 3 + ["dflash_block_qk"] * (1 + args.num_hidden_layers)
    for got, want in zip(kernel_context, pure_context, strict=True):
        np.testing.assert_allclose(f32(got), f32(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(kernel_hidden), f32(pure_hidden), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- selection and host tables

def test_selection_and_kill_switch(monkeypatch):
    monkeypatch.delenv(kernels.KILL_SWITCH_ENV, raising=False)
    monkeypatch.delenv(kernels.CUDA_OPT_IN_ENV, raising=False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert kernels.backend() == "metal"
    monkeypatch.setenv(kernels.KILL_SWITCH_ENV, "1")
    assert kernels.backend() is None
    monkeypatch.delenv(kernels.KILL_SWITCH_ENV)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert kernels.backend() is None  # the CUDA twin is opt-in until checked on a device
    monkeypatch.setenv(kernels.CUDA_OPT_IN_ENV, "1")
    assert kernels.backend() == "cuda"


def test_metal_kernel_is_built_once():
    # Constructing works everywhere (calling needs Metal); the object is cached.
    first = _common.compiled(context_kv.SPEC, "metal")
    assert _common.compiled(context_kv.SPEC, "metal") is first
    assert _common.compiled(block_qk.SPEC, "metal") is not first


def test_unsupported_ropes_keep_the_pure_path():
    assert kernels.rope_tables(nn.RoPE(64, traditional=True, base=10000.0), 64) is None
    assert kernels.rope_tables(nn.RoPE(32, base=10000.0), 64) is None  # partial rotation
    dynamic = initialize_rope(64, base=10000.0, traditional=False,
                              scaling_config={"type": "dynamic", "factor": 2.0}, max_position_embeddings=4096)
    assert kernels.rope_tables(dynamic, 64) is None
    yarn = make_rope("yarn", 64)
    tables = kernels.rope_tables(yarn, 64)
    assert tables is kernels.rope_tables(yarn, 64)  # computed once per module
    assert tables.input_scale == pytest.approx(yarn.mscale) and tables.input_scale != 1.0


def test_emulation_refuses_what_it_cannot_emulate(build_dir):
    # A SIMD-group reduction is not in the shim: compiling fails rather than emulating it wrongly.
    simd = dataclasses.replace(context_kv.SPEC, name="dflash_simd", source=context_kv.SOURCE.replace(
        "const uint row = thread_position_in_grid.x;", "const uint row = simd_sum(thread_position_in_grid.x);"))
    kv, weight = context_inputs(1, 2, 1, 1, 64, F32)
    with pytest.raises(RuntimeError, match="failed to compile"):
        run_context(simd, build_dir, kv=kv, weight=weight, rope=make_rope("default", 64), offset=0, dtype=F32)
