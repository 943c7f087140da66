"""Cost of the exact rollback on hybrid targets, against the verify pass it follows.

    python benchmarks/bench_rollback.py [--hidden 512 --layers 8 --context 512]

A random Qwen3.5-style target (GatedDeltaNet + attention every 4th layer)
verifies a 16-token block; then the rollback restores the recurrent state from
the pre-verify checkpoint and brings it forward over the kept inputs, either by
re-running only the GatedDeltaNet mixers on their inputs recorded during the
verify (what the engine does) or by replaying the whole model (the fallback for
sliding-window caches). Printed for several acceptance lengths, beside the verify.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: F401
import mlx.core as mx
from mlx_lm.utils import _get_classes

from mlx_dflash.targets.model import TargetModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402


def hybrid_target(hidden: int, layers: int, vocab: int):
    text = dict(
        model_type="qwen3_5_text", hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2, head_dim=64,
        vocab_size=vocab, linear_num_value_heads=hidden // 64, linear_num_key_heads=hidden // 128,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        full_attention_interval=4, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )
    config = dict(model_type="qwen3_5", text_config=text)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    return model


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    target = TargetModel(hybrid_target(args.hidden, args.layers, args.vocab))
    cache = target.make_cache()
    target.forward(mx.random.randint(0, args.vocab, (1, args.context)), cache)
    mx.eval([c.state for c in cache])
    block = mx.random.randint(0, args.vocab, (args.block,))

    def verify_then(kept: int | None, record: bool = True):
        saved = target.checkpoint(cache)
        hidden, _ = target.forward(block[None], cache, (), saved if record else None)
        mx.eval(target.logits(hidden), [c.state for c in cache])
        start = time.perf_counter()
        if kept is not None:
            target.rollback(cache, args.block - kept, saved, block[:kept])
            mx.eval([c.state for c in cache])
        elapsed = time.perf_counter() - start
        target.rollback(cache, kept or args.block, saved)  # back to the context alone
        return elapsed

    print(f"machine: {machine()}")
    print(f"target: random qwen3_5, hidden {args.hidden}, {args.layers} layers, context {args.context}; "
          f"block {args.block}; median of {args.repeats}\n")
    verify = timed(lambda: verify_then(None), args.repeats)
    print(f"verify pass ({args.block} tokens): {1e3 * verify:.2f} ms")
    print("kept tokens | mixer-only replay ms (share of verify) | full-model replay ms (share of verify)")
    for kept in (1, 4, 8, args.block - 1):
        mixers = statistics.median(verify_then(kept) for _ in range(args.repeats))
        full = statistics.median(verify_then(kept, record=False) for _ in range(args.repeats))
        print(f"{kept:11d} | {1e3 * mixers:20.2f} ({mixers / verify:4.0%}) | {1e3 * full:21.2f} ({full / verify:4.0%})")


if __name__ == "__main__":
    main()
