"""Per-cycle cost of DFlash decoding, and the draft cache's cost as the context grows.

    python benchmarks/bench_cycle.py                       # tiny random target
    python benchmarks/bench_cycle.py --model DIR           # any mlx-lm target (e.g. SmolLM2-135M)

Part 1 runs greedy generation with a random drafter (acceptance is near zero:
this measures cost, not speedup) at block sizes 4/8/16 and splits each cycle
into draft, verify and the rest (sampling, acceptance, cache bookkeeping).
Part 2 times one draft step at context 256/2k/8k with our preallocated cache
against a cache that concatenates the whole context every cycle.
Figures are printed with the machine's name; nothing here is a test.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx.core on Linux)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlx_dflash.drafters.draft_cache import DraftContextCache
from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs, default_target_layer_ids
from mlx_dflash.generate import stream_generate
from mlx_dflash.drafters.injection import ContextInjector
from mlx_dflash.targets.model import TargetModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        else:
            cpu = platform.processor()
    except OSError:
        cpu = platform.processor() or platform.machine()
    device = "Metal GPU" if mx.metal.is_available() else "CPU"
    blas = "OpenBLAS" if mlx_dflash.platform.setup.openblas_loaded else "bundled BLAS"
    return f"{cpu}, {platform.system()} {platform.machine()}, MLX {mx.__version__} {device} ({blas})"


def random_drafter(target: TargetModel, num_layers: int = 5, block_size: int = 16) -> DFlashDraftModel:
    a = target.args
    heads, kv_heads = a.num_attention_heads, a.num_key_value_heads
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // heads
    args = ModelArgs.from_dict({
        "hidden_size": a.hidden_size, "num_hidden_layers": num_layers,
        "intermediate_size": a.intermediate_size, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": target.vocab_size,
        "rope_theta": getattr(a, "rope_theta", 10000.0), "block_size": block_size,
        "dflash_config": {
            "mask_token_id": 0,
            "target_layer_ids": default_target_layer_ids(target.num_layers, num_layers),
        },
    })
    model = DFlashDraftModel(args)
    model.update(tree_map(lambda p: p.astype(target.dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def load_target(path: str | None) -> tuple[nn.Module, object, str]:
    if path is None:
        from helpers.tiny import FakeTokenizer, tiny_target

        name = "tiny random qwen3 (8 layers, hidden 64)"
        return tiny_target("qwen3", seed=0, num_layers=8), FakeTokenizer(eos_token_ids=()), name
    model, tokenizer, _ = mlx_dflash.load(path)
    return model, tokenizer, path


def per_cycle(model, tokenizer, drafter, prompt: list[int], block: int, tokens: int, repeats: int):
    rows = []
    for _ in range(repeats):
        events = list(stream_generate(model, tokenizer, prompt, draft_model=drafter, max_tokens=tokens,
                                      block_size=block, profile=True, stop_tokens=()))
        s = events[-1].stats
        cycles = max(s.cycles, 1)
        draft = s.timings.get("draft", 0.0) / cycles
        verify = s.timings.get("verify", 0.0) / cycles
        rows.append((draft, verify, s.decode_time / cycles - draft - verify, s.tau))
    return [statistics.median(col) for col in zip(*rows, strict=True)]


class ConcatenatingCache(DraftContextCache):
    """The naive design: the context is re-concatenated with the block every draft step."""

    def append(self, keys, values):
        if not self.keys:
            self.keys, self.values = list(keys), list(values)
        else:
            self.keys = [mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, keys, strict=True)]
            self.values = [mx.concatenate([a, b], axis=2) for a, b in zip(self.values, values, strict=True)]
        self.stored += keys[0].shape[2]

    def attend_span(self, layer, block_keys, block_values):
        return (mx.concatenate([self.keys[layer], block_keys], axis=2),
                mx.concatenate([self.values[layer], block_values], axis=2))


def draft_step_time(target: TargetModel, drafter: DFlashDraftModel, cache_cls, context: int,
                    block: int, steps: int) -> float:
    """Median seconds of one cycle's drafter work: inject one position, then draft a block."""
    args = drafter.args
    cache = cache_cls(args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
                      max_block_size=block, dtype=target.dtype)
    injector = ContextInjector(drafter)
    feats = len(drafter.target_layer_ids) * args.hidden_size
    for lo in range(0, context, 1024):
        n = min(1024, context - lo)
        injector(mx.random.normal((1, n, feats)).astype(target.dtype), lo, cache)
        mx.eval(cache.keys, cache.values)
    block_tokens = mx.array([1] + [args.mask_token_id] * (block - 1))[None]
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        injector(mx.random.normal((1, 1, feats)).astype(target.dtype), context + i, cache)
        hidden = drafter(target.embed(block_tokens), cache, context + i + 1)
        mx.eval(target.logits(hidden[:, 1:]).argmax(-1))
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm target directory (default: a tiny random model)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", default="256,2048,8192")
    parser.add_argument("--steps", type=int, default=10, help="draft steps timed per context")
    args = parser.parse_args()

    model, tokenizer, name = load_target(args.model)
    target = TargetModel(model)
    drafter = random_drafter(target)
    prompt = [(7 * i + 3) % target.vocab_size for i in range(64)]
    print(f"machine: {machine()}")
    print(f"target: {name}; drafter: random, {drafter.args.num_hidden_layers} layers; "
          f"{args.tokens} tokens, median of {args.repeats}\n")
    print("block | draft ms/cycle | verify ms/cycle | other ms/cycle | tau")
    per_cycle(model, tokenizer, drafter, prompt, 4, 8, 1)  # warm-up
    for block in (4, 8, 16):
        d, v, o, tau = per_cycle(model, tokenizer, drafter, prompt, block, args.tokens, args.repeats)
        print(f"{block:5d} | {1e3 * d:14.2f} | {1e3 * v:15.2f} | {1e3 * o:14.2f} | {tau:.2f}")
    base = per_cycle(model, tokenizer, None, prompt, 1, args.tokens, args.repeats)
    print(f"target alone: {1e3 * base[1]:.2f} ms per token (verify of 1)\n")

    print("context | draft step, our cache (ms) | draft step, concatenating cache (ms)")
    for context in (int(c) for c in args.contexts.split(",")):
        ours = draft_step_time(target, drafter, DraftContextCache, context, 16, args.steps)
        naive = draft_step_time(target, drafter, ConcatenatingCache, context, 16, args.steps)
        print(f"{context:7d} | {1e3 * ours:26.2f} | {1e3 * naive:36.2f}")


if __name__ == "__main__":
    main()
