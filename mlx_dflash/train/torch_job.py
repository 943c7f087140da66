"""A drafter training job for a CUDA machine with PyTorch and no MLX: prepared here, run there.

    python -m mlx_dflash.train.torch_job prepare --target T --data D.jsonl.gz --out JOB
        (MLX side) tokenizes each training conversation's prompt (`--every-turn`: the prompt
        at each assistant turn) with the target's chat template and writes JOB/job.json (the
        drafter's z-lab config, stop and pad ids) and JOB/prompts.npz; no tokenizer, template
        or MLX is needed where the job runs.
    python -m mlx_dflash.train.torch_job run --job JOB --target T --out OUT --minutes 8
        (PyTorch side) regenerates the replies with the target (greedy, batched), trains on
        them for the rest of the time budget, and writes OUT/drafter (z-lab layout, files of
        at most 15 MiB, rewritten whole every few minutes), OUT/replies.npz (reused by a later
        run's `--replies`) and OUT/log.txt. `--replies` takes an earlier run's replies.npz or a
        corpus folder made with MLX (`python -m mlx_dflash.train.corpus make`: manifest.json and
        sha256-checked shards); their prompts are not regenerated (`--regen-minutes 0`: train on
        them alone).
    python -m mlx_dflash.train.torch_job smoke --out OUT
        the run on a tiny random target, then again from a corpus folder of its replies, to check
        a machine in seconds.

The run prints one line per event; the same lines go to OUT/log.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DFlashError
from .corpus_files import reused_replies, write_corpus
from .data import Example
from .job_files import REPLIES_FILE, file_sha256, prepare, read_prompts, read_replies, split_file, write_replies
from .recipe import DEFAULT_LR, SCALE_EXAMPLES

Log = Callable[[str], None]


# ---------------------------------------------------------------- run (PyTorch side)

@dataclass
class RunOptions:
    minutes: float = 8.0
    regen_minutes: float = 2.5
    max_new_tokens: int = 256
    eval_prompts: int = 64
    regen_batch: int = 1024
    seq_len: int = 1024
    batch: int = 32
    blocks_per_seq: int = 64
    lr: float = DEFAULT_LR
    labels: str = "data"
    autocast: bool = True
    export_every_minutes: float = 2.0
    eval_every_minutes: float = 1.5
    replies: str = ""
    export_margin_seconds: float = 25.0
    shard_bytes: int = 15 * 2**20  # 16 MiB files come back from the GPU machine, headers included
    device: str = "cuda"
    seed: int = 0


RUN_HELP = {
    "minutes": "the whole run, loading and regeneration included",
    "regen_minutes": "at most this long regenerating training replies (then train on those done)",
    "max_new_tokens": "longest regenerated reply",
    "eval_prompts": "held-out prompts whose replies measure the drafter",
    "regen_batch": "prompts decoded together",
    "seq_len": "longest training sequence (prompt + reply)",
    "batch": "sequences per optimizer step",
    "blocks_per_seq": "draft blocks (anchors) per sequence",
    "lr": "peak learning rate (warm-up, then cosine to a tenth)",
    "labels": "data: the sequence's tokens (regenerated replies are the target's greedy output); "
              "target: the target's greedy predictions",
    "autocast": "bfloat16 forwards over float32 weights",
    "export_every_minutes": "rewrite OUT/drafter this often",
    "eval_every_minutes": "measure the held-out replies this often",
    "replies": "replies.npz of an earlier run, or a corpus folder (manifest.json + shards, sha256-checked): "
               "its replies are kept and their prompts not regenerated",
    "export_margin_seconds": "kept free at the end for the last evaluation and export",
    "shard_bytes": "largest weight file written",
    "device": "cuda, cpu, ...",
    "seed": "data order, anchors and initial weights",
}


def _examples(prompts: Sequence[Sequence[int]], replies: Sequence[tuple[list[int], int | None]], seq_len: int
              ) -> list[Example]:
    """Prompt + reply (+ the stop token that ended it); the reply and its stop token are the loss span."""
    out = []
    for prompt, (reply, stop) in zip(prompts, replies, strict=True):
        span = reply + ([stop] if stop is not None else [])
        if len(span) < 2:
            continue
        ids = list(prompt) + span
        out.append(Example(ids[:seq_len], ([False] * len(prompt) + [True] * len(span))[:seq_len]))
    return out


def regenerate_replies(target, prompts: Sequence[Sequence[int]], *, stop: Sequence[int], pad_id: int,
                       max_new_tokens: int, batch: int, deadline: float, seed: int, log: Log
                       ) -> tuple[list[list[int]], list[tuple[list[int], int | None]]]:
    """Greedy replies for as many prompts as the deadline allows: batches of similar length, in random order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks = [order[i:i + batch] for i in range(0, len(order), batch)]
    np.random.default_rng(seed).shuffle(chunks)
    done_prompts, done_replies = [], []
    for n, chunk in enumerate(chunks, start=1):
        if time.monotonic() > deadline:
            log(f"regenerate: time budget reached after {n - 1} of {len(chunks)} batches")
            break
        t = time.monotonic()
        chunk_prompts = [prompts[i] for i in chunk]
        replies = target.greedy(chunk_prompts, max_new_tokens=max_new_tokens, stop=stop, pad_id=pad_id)
        done_prompts.extend(chunk_prompts)
        done_replies.extend(replies)
        tokens = sum(len(r) for r, _ in replies)
        log(f"regenerate: batch {n}/{len(chunks)}, {len(chunk)} prompts, {tokens} reply tokens, "
            f"{time.monotonic() - t:.1f} s")
    return done_prompts, done_replies


def run_job(target, job: dict[str, Any], train_prompts: Sequence[Sequence[int]],
            eval_prompts: Sequence[Sequence[int]], out: Path, opts: RunOptions, log: Log) -> dict[str, Any]:
    """Regenerate, train until the budget is spent, export; returns the final evaluation."""
    import torch

    from .data import ExampleStream
    from .torch_model import TorchDFlashDrafter, init_from_target
    from .torch_trainer import TorchTrainConfig, TorchTrainer, planned_steps

    start = time.monotonic()
    end = start + opts.minutes * 60
    stop, pad_id = job["stop"], job["pad_id"]
    prompts, replies, from_corpus = reused_replies(opts.replies, job, eval_prompts, log)
    eval_prompts = list(eval_prompts)[: opts.eval_prompts]
    eval_replies = target.greedy(eval_prompts, max_new_tokens=opts.max_new_tokens, stop=stop, pad_id=pad_id) \
        if eval_prompts else []
    eval_examples = _examples(eval_prompts, eval_replies, opts.seq_len)
    known = {tuple(p) for p in prompts}
    todo = [p for p in train_prompts if tuple(p) not in known]
    log(f"regenerate: {len(prompts)} replies reused, {len(todo)} prompts to go")
    new_prompts, new_replies = regenerate_replies(target, todo, stop=stop, pad_id=pad_id,
                                                  max_new_tokens=opts.max_new_tokens, batch=opts.regen_batch,
                                                  deadline=start + opts.regen_minutes * 60, seed=opts.seed, log=log)
    # A corpus stays where it is (it travelled with the repository); replies.npz keeps what it lacks.
    kept = ([], []) if from_corpus else (prompts, replies)
    write_replies(out / REPLIES_FILE, kept[0] + new_prompts, kept[1] + new_replies)
    prompts, replies = prompts + new_prompts, replies + new_replies
    examples = _examples(prompts, replies, opts.seq_len)
    if not examples:
        raise DFlashError("no regenerated reply has two tokens or more")
    log(json.dumps({"event": "data", "examples": len(examples), "eval_examples": len(eval_examples),
                    "reply_tokens": sum(len(r) for r, _ in replies), "seconds": round(time.monotonic() - start, 1)}))

    torch.manual_seed(opts.seed)
    drafter = TorchDFlashDrafter(job["drafter"])
    init_from_target(drafter, target.layers, target.inner.norm)
    config = TorchTrainConfig(steps=10**6, batch=opts.batch, blocks_per_seq=opts.blocks_per_seq, lr=opts.lr,
                              labels=opts.labels, autocast=opts.autocast)
    trainer = TorchTrainer(target, drafter, config, pad_id=pad_id, seed=opts.seed)
    stream = ExampleStream(None, examples, max_tokens=opts.seq_len, seed=opts.seed)
    trainer.measure_feature_scale([stream.next() for _ in range(SCALE_EXAMPLES)])
    drafter_dir = out / "drafter"
    train_start = time.monotonic()
    last_export = last_eval = train_start
    budget_end = end - opts.export_margin_seconds
    seen = 0
    result: dict[str, Any] = {}

    def evaluate() -> dict[str, Any]:
        r = trainer.evaluate(eval_examples, batch=4) if eval_examples else {"tau": float("nan"), "accuracy": []}
        r = {"event": "eval", "step": trainer.step, "tau_block": round(r["tau"], 3),
             "accuracy": [round(a, 3) for a in r["accuracy"]], "tokens_seen": seen}
        log(json.dumps(r))
        return r

    while time.monotonic() < budget_end:
        batch = trainer.make_batch([stream.next() for _ in range(opts.batch)])
        r = trainer.train_step(batch)
        seen += r.tokens
        if trainer.step == 5 or trainer.step % 50 == 0:  # the pace so far sets the schedule's length
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            pace = (time.monotonic() - train_start) / trainer.step
            config.steps = trainer.step + planned_steps(budget_end - time.monotonic(), pace)
            if trainer.step == 5:
                log(f"train: {pace:.3f} s per step, planning {config.steps} steps")
        if trainer.step % 50 == 0 or trainer.step <= 2:
            log(json.dumps({"event": "step", "step": trainer.step, "loss": round(r.loss, 4), "lr": r.lr,
                            "accuracy": [round(a, 3) for a in r.accuracy[:4]], "tokens_seen": seen,
                            "seconds": round(time.monotonic() - train_start, 1)}))
        now = time.monotonic()
        if now - last_eval > opts.eval_every_minutes * 60:
            result = evaluate()
            last_eval = time.monotonic()
        if now - last_export > opts.export_every_minutes * 60:
            trainer.export(drafter_dir, shard_bytes=opts.shard_bytes)
            last_export = time.monotonic()
        if trainer.step >= config.steps:
            break
    result = evaluate()
    trainer.export(drafter_dir, shard_bytes=opts.shard_bytes)
    result.update({"event": "done", "steps": trainer.step, "train_seconds": round(time.monotonic() - train_start, 1),
                   "seconds": round(time.monotonic() - start, 1), "examples": len(examples)})
    log(json.dumps(result))
    return result


def _logger(out: Path) -> Log:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "log.txt"
    t0 = time.monotonic()

    def log(line: str) -> None:
        text = f"[{time.monotonic() - t0:7.1f}s] {line}"
        print(text, flush=True)
        with path.open("a") as f:
            f.write(text + "\n")

    return log


def run(job_dir: str | Path, target_path: str | Path, out: str | Path, opts: RunOptions) -> dict[str, Any]:
    from .torch_target import load_torch_target

    if opts.labels not in ("data", "target"):
        raise DFlashError(f"--labels must be data or target, got {opts.labels}")
    out = Path(out)
    job, train_prompts, eval_prompts = read_prompts(Path(job_dir))
    log = _logger(out)
    expected = job.get("target_sha256")
    if expected and Path(target_path).is_file() and file_sha256(Path(target_path)) != expected:
        raise DFlashError(f"{target_path}: not the target the job was prepared with (sha256 differs)")
    target = load_torch_target(target_path, opts.device)
    log(f"target: {target_path}, {target.num_layers} layers, on {opts.device}; "
        f"{len(train_prompts)} training prompts, {len(eval_prompts)} held out")
    return run_job(target, job, train_prompts, eval_prompts, out, opts, log)


def smoke(out: str | Path, device: str) -> dict[str, Any]:
    """The run, end to end, on a tiny random llama target: regenerate, train, export; then again from a corpus
    folder of those replies (written here with numpy, as `corpus make` writes one), regenerating nothing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .torch_target import TorchTarget

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    target = TorchTarget(LlamaForCausalLM(config).to(device))
    drafter = {"dflash_config": {"mask_token_id": 127, "target_layer_ids": [1, 2], "block_size": 8},
               "block_size": 8, "num_target_layers": 4, "num_hidden_layers": 1, "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "vocab_size": 128}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 120, size=int(rng.integers(4, 20))).tolist() for _ in range(40)]
    job = {"drafter": drafter, "stop": [2], "pad_id": 0}
    opts = RunOptions(minutes=0.25, regen_minutes=0.05, max_new_tokens=24, regen_batch=16, batch=4,
                      blocks_per_seq=8, export_every_minutes=0.1, eval_every_minutes=0.1,
                      export_margin_seconds=5, device=device, autocast=device == "cuda")
    out = Path(out)
    run_job(target, job, prompts[:32], prompts[32:], out, opts, _logger(out))
    corpus = out / "corpus"
    write_corpus(corpus, *read_replies(out / REPLIES_FILE), vocab_size=128, shard_prompts=8,
                 info={"stop": [2], "pad_id": 0, "target": {"file": "tiny random llama"}})
    again = replace(opts, minutes=0.15, regen_minutes=0.0, replies=str(corpus))
    return run_job(target, job, prompts[:32], prompts[32:], out / "from_corpus", again, _logger(out / "from_corpus"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_dflash.train.torch_job", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize prompts and write the job (needs MLX)")
    p.add_argument("--target", required=True, help="target: GGUF file, MLX/HF directory or Hub name")
    p.add_argument("--data", required=True, action="append", help="ShareGPT or messages JSON(L), gzip ok")
    p.add_argument("--out", required=True, help="job directory to write")
    p.add_argument("--layers", type=int, default=4, help="draft layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layers", default=None, help="comma-separated target layer ids")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--heldout", type=int, default=64, help="conversations kept out of training")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--every-turn", action="store_true",
                   help="a prompt at every assistant turn, not only the first (more training replies)")
    p.add_argument("--split-target", nargs="+", default=None, metavar="PART",
                   help="also cut the target file into these part files (for transfers with a size limit)")
    r = sub.add_parser("run", help="regenerate replies and train (needs PyTorch)")
    r.add_argument("--job", required=True, help="directory written by prepare")
    r.add_argument("--target", required=True, help="the same target: GGUF file or Hugging Face directory")
    r.add_argument("--out", required=True)
    s = sub.add_parser("smoke", help="a tiny end-to-end run on a random target")
    s.add_argument("--out", required=True)
    s.add_argument("--device", default=None)
    defaults = RunOptions()
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            r.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=RUN_HELP[name])
        else:
            r.add_argument(flag, type=type(value), default=value, help=f"{RUN_HELP[name]} (default: {value})")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            layers = [int(x) for x in args.target_layers.split(",")] if args.target_layers else None
            out = prepare(args.target, args.data, args.out, layers=args.layers, block_size=args.block_size,
                          target_layers=layers, mask_token_id=args.mask_token_id, heldout=args.heldout,
                          max_prompt_tokens=args.max_prompt_tokens, every_turn=args.every_turn)
            if args.split_target:
                split_file(args.target, args.split_target)
            print(f"prepared {out}")
        elif args.command == "run":
            opts = RunOptions(**{k: getattr(args, k) for k in vars(defaults)})
            run(args.job, args.target, args.out, opts)
        else:
            import torch

            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            smoke(args.out, device)
            print("smoke ok")
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
