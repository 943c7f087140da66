"""Draft-step time of a DFlash2 drafter against a v1 drafter of equal size, and the selector walk's share.

    python benchmarks/bench_dflash2.py                   # defaults below, random weights
    python benchmarks/bench_dflash2.py --hidden 2048 --vocab 151936 --layers 5

One target (random, only its embedding and lm_head matter for drafting) and two
drafters with the same attention/MLP shapes: v1, and DFlash2 (the same plus the
four convolutions per layer and the candidate selector). Each step drafts one
block after `--context` committed positions and is evaluated (mx.eval) before the
clock stops; medians of `--repeats` steps, run side by side in one process. The
selector is then timed alone on the block's hidden states and logits (top-k +
the sequential walk), greedy and sampled, to give its share of the DFlash2 step.
Random weights: this measures cost, not acceptance. The figures are printed with
the machine's name; on a shared machine they move with the load.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx.core on Linux)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cycle import machine  # noqa: E402

from mlx_dflash.drafters.dflash import DFlashDraftModel, ModelArgs  # noqa: E402
from mlx_dflash.drafters.dflash2 import DFlash2DraftModel  # noqa: E402
from mlx_dflash.drafters.dflash2 import ModelArgs as DFlash2Args  # noqa: E402
from mlx_dflash.proposers.factory import dflash_proposer  # noqa: E402
from mlx_dflash.targets.model import TargetModel  # noqa: E402


def randomize(model: nn.Module) -> None:
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * (0.02 if p.ndim > 1 else 1.0) + (p.ndim == 1),
                          model.parameters()))
    mx.eval(model.parameters())


def build(opts: argparse.Namespace) -> tuple[TargetModel, DFlashDraftModel, DFlash2DraftModel]:
    D, heads = opts.hidden, opts.hidden // 128
    config = dict(model_type="qwen3", hidden_size=D, num_hidden_layers=2, intermediate_size=3 * D,
                  num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=128,
                  rms_norm_eps=1e-6, vocab_size=opts.vocab, max_position_embeddings=40960,
                  tie_word_embeddings=True, rope_theta=1e6)
    model_cls, args_cls = _get_classes(config)
    target_model = model_cls(args_cls.from_dict(config))
    randomize(target_model)
    drafter_config = {
        **config, "num_hidden_layers": opts.layers, "block_size": opts.block,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1], "conv_kernel_size": opts.conv_kernel,
                          "conv_group_size": opts.conv_group, "selector_rank": opts.rank,
                          "selector_top_k": opts.top_k, "final_logit_softcapping": 30.0},
        "layer_types": ["sliding_attention"] * (opts.layers - 1) + ["full_attention"], "sliding_window": 2048,
    }
    v1 = DFlashDraftModel(ModelArgs.from_dict({**drafter_config, "layer_types": None, "sliding_window": None}))
    v2 = DFlash2DraftModel(DFlash2Args.from_dict(drafter_config))
    for m in (v1, v2):
        randomize(m)
        m.eval()
    return TargetModel(target_model), v1, v2


def interleaved_ms(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median milliseconds of each evaluated call, the calls taking turns (fair under a varying load)."""
    for fn in fns.values():
        mx.eval(fn())
        mx.eval(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def selector_inputs(v2: DFlash2DraftModel, proposer, target: TargetModel, last: mx.array,
                    opts: argparse.Namespace) -> tuple[mx.array, mx.array]:
    """One block's evaluated hidden states and logits, for timing the selector alone."""
    block = mx.concatenate([last, proposer._masks[: opts.block - 1]])
    hidden = v2(v2.embed(target, block[None]), proposer.cache, opts.context)[:, 1:]
    logits = v2.logits(hidden, target)
    mx.eval(hidden, logits)
    return hidden, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--conv-kernel", type=int, default=2)
    ap.add_argument("--conv-group", type=int, default=64)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    opts = ap.parse_args()
    mx.random.seed(0)
    target, v1, v2 = build(opts)
    print(f"machine: {machine()}")
    print(f"shapes: hidden {opts.hidden}, {opts.layers} draft layers, vocab {opts.vocab}, block {opts.block}, "
          f"context {opts.context}; DFlash2: conv {opts.conv_kernel} taps / groups of {opts.conv_group}, "
          f"selector rank {opts.rank}, top-{opts.top_k}")
    features = mx.random.normal((1, opts.context, 2 * opts.hidden))
    last = mx.array([17], dtype=mx.uint32)
    proposers = {}
    for name, drafter in (("v1", v1), ("DFlash2", v2)):
        proposers[name] = dflash_proposer(drafter, target, max_block_size=opts.block)
        proposers[name].commit(features, 0)
        mx.eval(proposers[name].state_arrays())
    hidden, logits = selector_inputs(v2, proposers["DFlash2"], target, last, opts)
    selector, n, v2_proposer = v2.candidate_selector, opts.context, proposers["DFlash2"]
    rows = interleaved_ms({
        "v1 draft step (greedy)": lambda: proposers["v1"].propose(last, n, opts.block),
        "DFlash2 draft step (greedy)": lambda: proposers["DFlash2"].propose(last, n, opts.block),
        "DFlash2 draft step (sampled, T=1)": lambda: v2_proposer.propose_sampled(last, n, opts.block, 1.0)[1].q,
        "selector alone (greedy: top-k + walk)": lambda: selector(hidden, logits, last).tokens,
        "selector alone (sampled)": lambda: selector(hidden, logits, last, 1.0).q,
        "top-k alone": lambda: mx.argpartition(logits, -opts.top_k, axis=-1),
    }, opts.repeats)
    width = max(map(len, rows))
    for name, ms in rows.items():
        print(f"{name:<{width}}  {ms:8.2f} ms")
    step = rows["DFlash2 draft step (greedy)"]
    print(f"DFlash2 / v1 draft step: {step / rows['v1 draft step (greedy)']:.2f}x; selector share of the DFlash2 "
          f"step: {rows['selector alone (greedy: top-k + walk)'] / step:.0%} greedy, "
          f"{rows['selector alone (sampled)'] / rows['DFlash2 draft step (sampled, T=1)']:.0%} sampled")


if __name__ == "__main__":
    main()
