"""The files of a PyTorch training job: written where MLX is (prepare), read where PyTorch is (run).

JOB/job.json holds the drafter's z-lab config, the stop and pad ids and the target's
sha256; JOB/prompts.npz the tokenized training and held-out prompts; a run's
OUT/replies.npz its (prompt, reply, stop token) triples, which a later run can keep.
Token sequences are stored flat with offsets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DFlashError

JOB_FILE = "job.json"
PROMPTS_FILE = "prompts.npz"
REPLIES_FILE = "replies.npz"


def pack(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in sequences])
    flat = np.fromiter((t for s in sequences for t in s), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


def unpack(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(target: str, data: Sequence[str], out: str | Path, *, layers: int = 4, block_size: int = 16,
            target_layers: list[int] | None = None, mask_token_id: int | None = None, heldout: int = 64,
            seed: int = 0, max_prompt_tokens: int = 512, every_turn: bool = False) -> Path:
    """Write job.json and prompts.npz for `run`: everything that needs the tokenizer or MLX."""
    from ..loading.loaders import load_target
    from ..targets.model import TargetModel
    from .data import load_conversations, prompt_ids, split_heldout, turn_prompts
    from .recipe import drafter_config
    from .trainer import TrainConfig, build_drafter_args

    model, tokenizer = load_target(target)
    args = build_drafter_args(TrainConfig(target=str(target), data=list(data), out=str(out), layers=layers,
                                          block_size=block_size, target_layers=target_layers,
                                          mask_token_id=mask_token_id), TargetModel(model), tokenizer)
    conversations = load_conversations(data)
    train, held = split_heldout(conversations, heldout, seed)

    def prompts(convs, each_turn: bool) -> list[list[int]]:
        ids = (p for c in convs for p in (turn_prompts(tokenizer, c) if each_turn else [prompt_ids(tokenizer, c)]))
        return [p for p in ids if len(p) <= max_prompt_tokens]

    train_prompts, eval_prompts = prompts(train, every_turn), prompts(held, False)
    if not train_prompts:
        raise DFlashError(f"no training prompt has at most {max_prompt_tokens} tokens")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_flat, train_offsets = pack(train_prompts)
    eval_flat, eval_offsets = pack(eval_prompts)
    np.savez_compressed(out / PROMPTS_FILE, train_tokens=train_flat, train_offsets=train_offsets,
                        eval_tokens=eval_flat, eval_offsets=eval_offsets)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    job = {"drafter": drafter_config(args), "stop": sorted(int(i) for i in tokenizer.eos_token_ids),
           "pad_id": int(pad_id), "seed": seed, "heldout": heldout, "data": [Path(d).name for d in data],
           "train_prompts": len(train_prompts), "eval_prompts": len(eval_prompts),
           "max_prompt_tokens": max_prompt_tokens, "every_turn": every_turn}
    if Path(target).is_file():
        job["target_sha256"] = file_sha256(Path(target))
    (out / JOB_FILE).write_text(json.dumps(job, indent=2) + "\n")
    return out


def split_file(path: str | Path, parts: Sequence[str | Path]) -> list[Path]:
    """Cut a file into len(parts) pieces of near-equal size (joined again with `cat`)."""
    data = Path(path).read_bytes()
    size = -(-len(data) // len(parts))
    written = []
    for i, part in enumerate(parts):
        p = Path(part)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data[i * size:(i + 1) * size])
        written.append(p)
    return written


def write_replies(path: Path, prompts: Sequence[Sequence[int]],
                  replies: Sequence[tuple[list[int], int | None]]) -> None:
    p_flat, p_off = pack(prompts)
    r_flat, r_off = pack([r for r, _ in replies])
    np.savez_compressed(path, prompt_tokens=p_flat, prompt_offsets=p_off, reply_tokens=r_flat, reply_offsets=r_off,
                        reply_stop=np.array([-1 if s is None else s for _, s in replies], dtype=np.int64))


def read_replies(path: Path) -> tuple[list[list[int]], list[tuple[list[int], int | None]]]:
    """The (prompt, (reply, stop token or None)) pairs a run saved in replies.npz."""
    try:
        r = np.load(path)
        prompts = unpack(r["prompt_tokens"], r["prompt_offsets"])
        replies = unpack(r["reply_tokens"], r["reply_offsets"])
        stops = [None if s < 0 else int(s) for s in r["reply_stop"].tolist()]
    except (OSError, KeyError, ValueError) as e:
        raise DFlashError(f"{path}: not a replies file written by a run ({e})") from None
    return prompts, list(zip(replies, stops, strict=True))


def read_prompts(job_dir: Path) -> tuple[dict[str, Any], list[list[int]], list[list[int]]]:
    try:
        job = json.loads((job_dir / JOB_FILE).read_text())
        p = np.load(job_dir / PROMPTS_FILE)
    except (OSError, ValueError) as e:
        raise DFlashError(f"{job_dir}: not a prepared job ({e})") from None
    return job, unpack(p["train_tokens"], p["train_offsets"]), unpack(p["eval_tokens"], p["eval_offsets"])
