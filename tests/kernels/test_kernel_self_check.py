"""The kernels' self-check: a kernel that fails on first use falls back to its pure-MLX twin.

The Metal kernels have never been compiled by Metal in CI, so the first call of each kernel
class in a process compares it with its reference (`mlx_dflash.kernels.self_check`). Here the
kernels run through the host emulation (tests/helpers/emulate_metal.py): a correct kernel passes and is
used; a kernel with a wrong formula, one that does not compile, and one that raises are all
caught, warned about once, replaced by the reference, and greedy decoding stays exactly the
target alone's. MLX_DFLASH_KERNELS=off launches nothing; =on skips the check.
"""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import numpy as np
import pytest
from helpers.emulate_metal import EmulatedKernel, compiler_available
from helpers.kernel_cases import ROPES, make_rope
from helpers.tiny import greedy_reference

from mlx_dflash import kernels, stream_generate
from mlx_dflash.drafters.injection import inject_context_kv_reference
from mlx_dflash.kernels import _common, block_qk, context_kv, self_check

needs_compiler = pytest.mark.skipif(not compiler_available(), reason="g++ is needed to emulate the Metal kernels")
PROMPT = [5, 17, 42, 9, 77, 31, 8, 64, 12, 90, 33, 21]


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    monkeypatch.delenv(_common.MODE_ENV, raising=False)
    monkeypatch.delenv(_common.KILL_SWITCH_ENV, raising=False)
    self_check.forget()
    yield
    self_check.forget()


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("self_check_emulation")


def use_kernels(monkeypatch, make_kernel) -> list[str]:
    """Route every kernel launch through `make_kernel(spec)`; returns the launch log."""
    launches: list[str] = []

    class Logged:
        def __init__(self, spec):
            self.spec, self.inner = spec, make_kernel(spec)

        def __call__(self, **kwargs):
            launches.append(self.spec.name)
            return self.inner(**kwargs)

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.setattr(_common, "compiled", lambda spec, kind: Logged(spec))
    return launches


def decode(targets, drafters, max_tokens: int = 24) -> tuple[list[int], list[int]]:
    model, draft = targets("qwen3"), drafters("qwen3", block_size=16)
    from helpers.tiny import FakeTokenizer

    tokens = []
    for event in stream_generate(model, FakeTokenizer(), PROMPT, draft_model=draft, max_tokens=max_tokens,
                                 block_size=8, prompt_lookup=False):
        tokens.extend(event.tokens)
    return tokens, greedy_reference(model, PROMPT, max_tokens)


# ---------------------------------------------------------------- the references the check trusts

@pytest.mark.parametrize("rope_name", list(ROPES))
def test_table_references_equal_the_engines_pure_path(rope_name):
    """The self-check's twins (rope as tables) compute what the engine's pure-MLX path computes."""
    rope = make_rope(rope_name, 64)
    tables = kernels.rope_tables(rope, 64)
    kv = self_check.small_normal((2, 5, 3, 2, 2, 64), mx.float32, seed=0, scale=2.0)
    weight = self_check.small_normal((3, 64), mx.float32, seed=1, scale=0.2, shift=1.0)
    got = context_kv.context_kv_reference(kv=kv, k_norm_weight=weight, eps=1e-6, tables=tables, offset=4000,
                                          dtype=mx.float32)
    want = inject_context_kv_reference(kv=kv, k_norm_weight=weight, eps=1e-6, rope=rope, offset=4000,
                                       dtype=mx.float32)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-4)

    q = self_check.small_normal((1, 6, 4 * 64), mx.float32, seed=2)
    k = self_check.small_normal((1, 6, 2 * 64), mx.float32, seed=3)
    qw, kw = (self_check.small_normal((64,), mx.float32, seed=s, scale=0.2, shift=1.0) for s in (4, 5))
    q_out, k_out = block_qk.block_qk_reference(q=q, k=k, q_norm_weight=qw, k_norm_weight=kw, q_eps=1e-6, k_eps=1e-6,
                                               tables=tables, offset=77, num_heads=4, num_kv_heads=2)
    want_q = rope(mx.fast.rms_norm(q.reshape(1, 6, 4, 64), qw, 1e-6).transpose(0, 2, 1, 3), offset=77)
    want_k = rope(mx.fast.rms_norm(k.reshape(1, 6, 2, 64), kw, 1e-6).transpose(0, 2, 1, 3), offset=77)
    np.testing.assert_allclose(np.array(q_out), np.array(want_q), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(k_out), np.array(want_k), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the check on emulated kernels

@needs_compiler
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_correct_kernels_pass_their_check_and_are_used(monkeypatch, build_dir, targets, drafters, dtype, caplog):
    launches = use_kernels(monkeypatch, lambda spec: EmulatedKernel(spec, build_dir))
    tables = kernels.rope_tables(make_rope("default", 64), 64)
    kv = self_check.small_normal((1, 4, 2, 2, 2, 64), dtype, seed=9)
    weight = self_check.small_normal((2, 64), dtype, seed=8, shift=1.0, scale=0.1)
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        for _ in range(2):
            kernels.inject_context_kv(kv=kv, k_norm_weight=weight, eps=1e-6, tables=tables, offset=3, dtype=dtype)
    # One check launch, then the two real ones: the check runs once per class.
    assert launches == ["dflash_context_kv"] * 3
    [result] = self_check.results()
    assert result.passed and result.kernel == "dflash_context_kv" and result.head_dim == 64
    assert result.max_error <= result.tolerance
    assert not caplog.records


BREAKAGES = {
    "wrong formula": lambda spec: EmulatedKernel(  # the rope's rotation sign flipped
        dataclasses.replace(spec, name=spec.name + "_sign",
                            header=spec.header.replace("a * c - b * s", "a * c + b * s")),
        BUILD_DIR[0]),
    "does not compile": lambda spec: EmulatedKernel(
        dataclasses.replace(spec, name=spec.name + "_syntax", source=spec.source + "\nthis is not C++;\n"),
        BUILD_DIR[0]),
    "raises": lambda spec: _Raising(),
}
BUILD_DIR: list = []


class _Raising:
    def __call__(self, **kwargs):
        raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: unknown type")


@needs_compiler
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_failing_kernel_falls_back_and_output_stays_exact(monkeypatch, build_dir, targets, drafters, breakage,
                                                            caplog):
    BUILD_DIR[:] = [build_dir]
    launches = use_kernels(monkeypatch, BREAKAGES[breakage])
    with caplog.at_level(logging.WARNING, logger="mlx_dflash"):
        tokens, reference = decode(targets, drafters)
    assert tokens == reference
    # Each kernel was tried once (its check) and never launched again.
    assert sorted(launches) == ["dflash_block_qk", "dflash_context_kv"]
    assert {r.kernel for r in self_check.results()} == {"dflash_block_qk", "dflash_context_kv"}
    assert not any(r.passed for r in self_check.results())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one line per kernel, not one per call
    for line in lines:
        assert "failed its self-check" in line and mx.__version__ in line and "\n" not in line
        assert self_check.device_name() in line
    if breakage == "wrong formula":
        assert all("max error" in r.error for r in self_check.results())
    elif breakage == "does not compile":
        assert all("failed to compile" in r.error for r in self_check.results())
    else:
        assert all(r.error.startswith("RuntimeError: [metal::Device] Unable to build") for r in self_check.results())


@needs_compiler
def test_without_the_check_a_broken_kernel_would_change_the_output(monkeypatch, build_dir, targets, drafters):
    """MLX_DFLASH_KERNELS=on trusts the kernels: the same breakage now reaches the drafts (what the check
    prevents); greedy output stays exact all the same, since the target verifies every draft."""
    BUILD_DIR[:] = [build_dir]
    monkeypatch.setenv(_common.MODE_ENV, "on")
    launches = use_kernels(monkeypatch, BREAKAGES["wrong formula"])
    tokens, reference = decode(targets, drafters)
    assert tokens == reference
    assert not self_check.results()
    assert launches.count("dflash_block_qk") > 2  # launched every cycle, never checked


def test_off_launches_nothing_and_bad_values_are_refused(monkeypatch, targets, drafters):
    monkeypatch.setenv(_common.MODE_ENV, "off")
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert kernels.backend() is None
    monkeypatch.setattr(_common, "compiled", lambda spec, kind: pytest.fail("a kernel was built with kernels off"))
    tokens, reference = decode(targets, drafters, max_tokens=8)
    assert tokens == reference
    monkeypatch.setenv(_common.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="MLX_DFLASH_KERNELS"):
        kernels.backend()
    monkeypatch.setenv(_common.MODE_ENV, "ON")
    assert kernels.mode() == "on"
    monkeypatch.delenv(_common.MODE_ENV)
    monkeypatch.setenv(_common.KILL_SWITCH_ENV, "1")
    assert kernels.mode() == "off"


def test_a_check_is_per_kernel_dtype_and_head_dim():
    calls = []

    def trial(result):
        def run():
            calls.append(1)
            x = mx.ones((2, 3))
            return [x + result], [x]
        return run

    assert self_check.usable("k", "metal", mx.float32, 64, trial(0.0))
    assert self_check.usable("k", "metal", mx.float32, 64, trial(1.0))  # cached: not run again
    assert not self_check.usable("k", "metal", mx.float16, 64, trial(1.0))
    assert not self_check.usable("k", "metal", mx.float32, 128, trial(float("nan")))
    assert len(calls) == 3
    assert [r.passed for r in self_check.results()] == [True, False, False]
