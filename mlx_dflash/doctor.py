"""`dflash-mlx doctor`: whether this machine runs mlx-dflash right, in one report.

The checks a user runs first and pastes into a bug report: the device, its memory and
the versions; each custom kernel's self-check against its pure-MLX twin; a lossless
check (greedy DFlash equals the target alone, token for token) on a tiny fixture built
here from fixed seeds, in the device's default dtype and in float16; and a short speed
check of a real pair. Each returns plain data (JSON-ready); the CLI draws it.
"""

from __future__ import annotations

import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from . import kernels
from .drafters.dflash import DFlashDraftModel, ModelArgs
from .generate import stream_generate
from .platform.runtime import device_memory
from .targets import dtypes

FIXTURE_VOCAB = 512
FIXTURE_TOKENS = 40
# Where a verify pass and a one-token step round differently, a flip is only honest at a
# near-tie of the target's own top two logits: within this many units in the last place.
NEAR_TIE_ULPS = 8
EPSILON = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def environment() -> dict[str, Any]:
    """The device, its memory and the versions that matter to a bug report."""
    _, total = device_memory()
    try:
        info = dict(mx.device_info())
    except Exception:  # noqa: BLE001
        info = {}
    versions = {"python": platform.python_version(), "mlx": mx.__version__}
    for package in ("mlx-lm", "mlx-dflash", "mlx-metal"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    backend = "metal" if mx.metal.is_available() else "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() \
        else "cpu"
    return {
        "device": str(info.get("device_name", platform.processor() or platform.machine())),
        "architecture": str(info.get("architecture", platform.machine())),
        "backend": backend,
        "os": f"{platform.system()} {platform.release()}" + (f" (macOS {platform.mac_ver()[0]})"
                                                              if sys.platform == "darwin" else ""),
        "memory_bytes": total,
        "recommended_working_set_bytes": info.get("max_recommended_working_set_size"),
        "versions": versions,
        "kernel_mode": kernels.mode(),
        "kernel_backend": kernels.backend(),
    }


def default_dtype() -> mx.Dtype:
    """What this device computes in by default: float32 on a CPU, the checkpoints' bfloat16 on a GPU."""
    return dtypes.default_dtype() or mx.bfloat16


def kernel_checks(dtypes: list[mx.Dtype], head_dims: tuple[int, ...] = (128,)) -> list[dict[str, Any]]:
    """Each kernel's self-check, run now for each dtype (also under MLX_DFLASH_KERNELS=on)."""
    from .kernels import block_qk, context_kv, self_check

    backend = kernels.backend()
    if backend is None:
        reason = "kernels are off (MLX_DFLASH_KERNELS=off)" if kernels.mode() == "off" \
            else "no Metal device: the pure-MLX path runs"
        return [{"kernel": spec.name, "passed": None, "skipped": reason}
                for spec in (context_kv.SPEC, block_qk.SPEC)]
    out = []
    for head_dim in head_dims:
        tables = kernels.rope_tables(nn.RoPE(head_dim, base=1_000_000.0), head_dim)
        for dtype in dtypes:
            trials = {
                context_kv.SPEC.name: partial(context_kv.trial, backend, dtype, dtype, tables, head_dim),
                block_qk.SPEC.name: partial(block_qk.trial, backend, dtype, tables, head_dim),
            }
            for name, trial in trials.items():
                out.append(self_check.run_check(name, backend, dtype, head_dim, trial).as_dict())
    return out


@dataclass
class Fixture:
    target: nn.Module
    drafter: DFlashDraftModel


def tiny_fixture(dtype: mx.Dtype, seed: int = 0) -> Fixture:
    """A tiny Qwen3 target and a DFlash drafter for it, from fixed seeds (the same on every machine),
    with head dimensions of real checkpoints (128) so the kernels run the shapes they run for users."""
    config = dict(model_type="qwen3", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  vocab_size=FIXTURE_VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_theta=1_000_000.0)
    model_cls, args_cls = _get_classes(config)
    target = model_cls(args_cls.from_dict(config))
    drafter = DFlashDraftModel(ModelArgs.from_dict({
        "model_type": "qwen3", "block_size": 16, "num_target_layers": 4, "num_hidden_layers": 2,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2]}, "hidden_size": 256,
        "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "vocab_size": FIXTURE_VOCAB, "layer_types": ["full_attention"] * 2,
    }))
    rng = np.random.default_rng(seed)
    for module, scale in ((target, 2.0), (drafter, 1.0)):  # a larger scale: decisive logits, few near-ties
        params = tree_flatten(module.parameters())
        module.load_weights([
            (name, mx.array(1.0 + 0.1 * rng.standard_normal(p.shape) if p.ndim == 1
                            else scale * rng.standard_normal(p.shape) / np.sqrt(p.shape[-1]),
                            dtype=mx.float32).astype(dtype))
            for name, p in params
        ])
    mx.eval(target.parameters(), drafter.parameters())
    return Fixture(target, drafter)


class _Ids:
    """The least tokenizer `stream_generate` needs for token ids (no text, no end token)."""

    eos_token_ids: tuple[int, ...] = ()

    class detokenizer:  # noqa: N801 - the attribute name generate expects
        last_segment = ""

        @staticmethod
        def reset() -> None: ...

        @staticmethod
        def add_token(token: int) -> None: ...

        @staticmethod
        def finalize() -> None: ...


def fixture_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    phrase = [int(t) for t in rng.integers(4, FIXTURE_VOCAB, 9)]
    return [
        [int(t) for t in rng.integers(4, FIXTURE_VOCAB, 30)],  # nothing to copy: drafts only
        phrase * 4 + phrase[:3],  # repeats: prompt lookup proposes long runs
        [int(t) for t in rng.integers(4, FIXTURE_VOCAB, 3)],
    ]


def _tokens(model: nn.Module, prompt: list[int], **kwargs: Any) -> list[int]:
    return [t for event in stream_generate(model, _Ids(), prompt, max_tokens=FIXTURE_TOKENS, **kwargs)
            for t in event.tokens]


def near_tie_margin(model: nn.Module, prefix: list[int], dtype: mx.Dtype) -> tuple[float, float]:
    """(gap between the target's top two logits after `prefix`, the near-tie bound at that magnitude)."""
    logits = model(mx.array(prefix, dtype=mx.uint32)[None])[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return top[1] - top[0], NEAR_TIE_ULPS * EPSILON.get(dtype, EPSILON[mx.float32]) * max(1.0, abs(top[1]))


def lossless_check(dtype: mx.Dtype) -> dict[str, Any]:
    """Greedy DFlash (blocks of 16 and `auto`, prompt lookup on) against the target alone on the fixture."""
    fixture = tiny_fixture(dtype)
    cases, passed = [], True
    for index, prompt in enumerate(fixture_prompts()):
        alone = _tokens(fixture.target, prompt, draft_model=None, prompt_lookup=False)
        for block_size in (16, "auto"):
            got = _tokens(fixture.target, prompt, draft_model=fixture.drafter, block_size=block_size)
            case: dict[str, Any] = {"prompt": index, "block_size": block_size, "identical": got == alone}
            if got != alone:
                at = next((i for i, (a, b) in enumerate(zip(got, alone, strict=False)) if a != b),
                          min(len(got), len(alone)))
                gap, bound = near_tie_margin(fixture.target, prompt + alone[:at], dtype)
                case.update(position=at, top2_gap=gap, near_tie_bound=bound, near_tie=gap <= bound)
                passed = passed and gap <= bound
            cases.append(case)
    return {"dtype": str(dtype).removeprefix("mlx.core."), "passed": passed, "tokens": FIXTURE_TOKENS,
            "cases": cases}


def speed_check(model: nn.Module, tokenizer: Any, drafter: Any, prompt: list[int], *, max_tokens: int,
                lookup: bool) -> dict[str, Any]:
    """Target alone, then DFlash as `generate` runs it by default (`auto`), on one prompt, after a warm-up."""
    runs: dict[str, Any] = {}
    outputs = {}
    for name, kwargs in (("target", dict(draft_model=None, prompt_lookup=False)),
                         ("dflash", dict(draft_model=drafter, prompt_lookup=lookup))):
        for _ in stream_generate(model, tokenizer, prompt, max_tokens=8, **kwargs):
            pass  # warm-up: kernels built, caches sized
        tokens, event = [], None
        start = time.perf_counter()
        for event in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
            tokens.extend(event.tokens)
        seconds = time.perf_counter() - start
        stats = event.stats
        outputs[name] = tokens
        runs[name] = {"tokens": len(tokens), "seconds": round(seconds, 3),
                      "tok_per_s": round(stats.generation_tps, 2), "tau": round(stats.tau, 2),
                      "block_sizes": {str(k): v for k, v in sorted(Counter(stats.block_sizes).items())},
                      "accepted_by_source": stats.accepted_by_source}
    target_tps, dflash_tps = runs["target"]["tok_per_s"], runs["dflash"]["tok_per_s"]
    return {**runs, "speedup": round(dflash_tps / target_tps, 3) if target_tps else None,
            "same_tokens": outputs["target"] == outputs["dflash"], "prompt_tokens": len(prompt)}
