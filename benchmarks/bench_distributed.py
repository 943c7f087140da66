"""DFlash and the target alone on 1 rank and on N ranks (mlx.launch, ring over loopback), side by side.

    python benchmarks/bench_distributed.py [--model M --draft D | --oracle-q 0.2] [--ranks 2] [--max-tokens 48]

Each configuration runs in its own launch (rank 0 reports); the table gives decode tok/s, tau and the
estimated communication per cycle (all-reduces per cycle x a measured all-reduce of that size) and its
share of the cycle. Without --model the target is a random one of SmolLM2-135M's size with heads that
split in two (SmolLM2's 9 attention heads do not), and DFlash drafts with the benchmark-only
corrupted-greedy proposer (the target's own greedy continuation, each position wrong with
probability q): a drafter of known quality. On one machine the ranks share its cores and memory
bandwidth, so no speedup is expected here: the point is the overhead and where it goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"
SYNTHETIC = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                 num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=49152,
                 rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def synthetic_target() -> Path:
    """A random SmolLM2-sized llama on disk (made once), loaded by ranks as any model directory."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    path = Path(tempfile.gettempdir()) / "mlx-dflash-bench-synthetic-llama"
    if not (path / "config.json").is_file():
        mx.random.seed(0)
        model_cls, args_cls = _get_classes(SYNTHETIC)
        model = model_cls(args_cls.from_dict(SYNTHETIC))
        path.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (path / "config.json").write_text(json.dumps(SYNTHETIC))
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SYNTHETIC["vocab_size"])}, unk_token="t0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        words.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                "eos_token": "t1"}))
    return path


def prompts_for(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    if args.oracle_q is not None:  # random ids: the synthetic target has no tokenizer worth the name
        return [[(17 * i + 31 * j) % 40000 + 100 for j in range(48)] for i in range(args.prompts)]
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: args.prompts]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions]


def worker(args: argparse.Namespace) -> None:
    import mlx.core as mx

    import mlx_dflash
    from mlx_dflash.bench.proposers import CorruptedGreedyProposer
    from mlx_dflash.distributed.world import one_rank_at_a_time, world
    from mlx_dflash.loading.loaders import load_target
    from mlx_dflash.loading.resolve import choose_pair
    from mlx_dflash.targets.model import as_target

    if args.oracle_q is not None:
        model, tokenizer = load_target(one_rank_at_a_time(synthetic_target))
        drafter = None
    else:
        pair = choose_pair(args.model, args.draft, no_draft=args.no_draft)
        model, tokenizer, drafter = mlx_dflash.load(pair.target, pair.draft)
    prompts = prompts_for(args, tokenizer)
    tokens = seconds = 0.0
    lengths, sizes = [], []
    for i, ids in enumerate(prompts + prompts[:1]):  # the first prompt again at the end: warm-up is run 0
        if args.oracle_q is not None and not args.no_draft:
            greedy = [t for e in mlx_dflash.stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens)
                      for t in e.tokens]  # untimed: the continuation the proposer corrupts
            drafter = CorruptedGreedyProposer(ids + greedy, as_target(model).vocab_size, args.oracle_q, seed=i)
        events = list(mlx_dflash.stream_generate(model, tokenizer, ids, draft_model=drafter,
                                                 max_tokens=args.max_tokens, block_size=args.block_size))
        if i == 0:
            continue
        stats = events[-1].stats
        tokens += max(stats.num_tokens - 1, 0)
        seconds += stats.decode_time
        lengths += stats.acceptance_lengths
        sizes += stats.block_sizes
    w = world()
    target = as_target(model)
    rows = max(1, round(sum(sizes) / max(len(sizes), 1)))
    comm = w.cycle_comm_ms(target.num_layers, rows, target.hidden_size) if w is not None else 0.0
    cycle_ms = 1000 * seconds / max(len(lengths), 1)
    if w is None or w.is_main:
        print("RESULT " + json.dumps({
            "ranks": 1 if w is None else w.size, "draft": drafter is not None, "tok_s": tokens / seconds,
            "tau": sum(lengths) / max(len(lengths), 1), "cycle_ms": cycle_ms, "comm_ms": comm,
            "peak_gb": mx.get_peak_memory() / 1e9,
        }), flush=True)


def run(args: argparse.Namespace, ranks: int, no_draft: bool) -> dict:
    me = [sys.executable, __file__, "--worker", "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
          "--block-size", str(args.block_size), *(["--model", args.model] if args.model else []),
          *(["--oracle-q", str(args.oracle_q)] if args.oracle_q is not None else []),
          *(["--draft", args.draft] if args.draft else []), *(["--no-draft"] if no_draft else [])]
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    command = me if ranks == 1 else [launch, "-n", str(ranks), "--backend", "ring", *me]
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"no result from {' '.join(command)}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--draft")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--block-size", default="auto")
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--oracle-q", type=float, default=None,
                        help="synthetic target, corrupted-greedy proposer at this error rate (without --model: 0.2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.block_size.isdigit():
        args.block_size = int(args.block_size)
    if args.oracle_q is None and args.model is None and args.draft is None:
        args.oracle_q = 0.2
    if args.worker:
        return worker(args)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}, "
          f"python {platform.python_version()}; ranks share this one machine (loopback ring)")
    print(f"{'ranks':>5} {'mode':<12} {'tok/s':>7} {'tau':>5} {'cycle ms':>9} {'comm ms':>8} {'comm share':>10} "
          f"{'peak GB, rank 0':>15}")
    for no_draft in (True, False):
        for ranks in (1, args.ranks):
            started = time.perf_counter()
            r = run(args, ranks, no_draft)
            share = r["comm_ms"] / r["cycle_ms"] if r["cycle_ms"] else 0.0
            mode = "target alone" if no_draft else "DFlash"
            print(f"{r['ranks']:>5} {mode:<12} {r['tok_s']:>7.2f} {r['tau']:>5.2f} {r['cycle_ms']:>9.1f} "
                  f"{r['comm_ms']:>8.1f} {share:>10.0%} {r['peak_gb']:>15.2f}   "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
